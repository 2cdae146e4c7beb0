"""Config loading: defaults, the shipped config.toml, and errors that name file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from soakd import config
from soakd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text, encoding="utf-8")
    return p


def test_shipped_config_equals_builtin_defaults() -> None:
    shipped = config.load(ROOT / "config.toml")
    assert shipped.model_dump() == config.load(None).model_dump()
    assert shipped.base_dir == ROOT


def test_values_are_typed_and_frozen(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, '[run]\nduration = "1h30m"\n[replay]\nspeed = 2\n'))
    assert cfg.run.duration == 5400.0
    assert cfg.replay.speed == 2.0
    with pytest.raises(ValueError, match="frozen"):
        cfg.run.duration = 1.0  # type: ignore[misc]


def test_relative_paths_resolve_against_the_config_folder(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, '[run]\noutput_dir = "out"\n'))
    assert cfg.resolve(cfg.run.output_dir) == tmp_path.resolve() / "out"
    assert cfg.resolve("/abs/x") == Path("/abs/x")


@pytest.mark.parametrize(
    ("text", "line", "key", "reason"),
    [
        ("[run]\nname = 'x'\nbogus = 1\n", 3, "run.bogus", "unknown key"),
        ("[run]\n\n[engine]\nmax_num_seqs = 'many'\n", 4, "engine.max_num_seqs", "valid integer"),
        ("[replay]\nspeed = 0\n", 2, "replay.speed", "greater than 0"),
        ("[run]\nduration = '10 parsecs'\n", 2, "run.duration", "not a duration"),
        (
            "[engine.speculative]\nmethod = 'ngram'\nnum_speculative_tokens = 99\n",
            3,
            "engine.speculative.num_speculative_tokens",
            "less than or equal to 16",
        ),
        ("[telemetry]\ncollectors = ['host', 'gpux']\n", 2, "telemetry.collectors.1", "'host'"),
        ("[criteria]\nmax_error_rate = 1.5\n", 2, "criteria.max_error_rate", "less than or equal to 1"),
        ("[control.batch]\nfloor = 0\n", 2, "control.batch.floor", "greater than or equal to 1"),
        ("[control.batch]\nlever = 'magic'\n", 2, "control.batch.lever", "'admission'"),
        ("[nope]\nx = 1\n", 1, "nope", "unknown key"),
        # A typo gets the closest key of its table, in lists of tables too; nothing close, nothing said.
        ("[run]\ndurration = '10m'\n", 2, "run.durration", "unknown key (did you mean 'duration'?)"),
        ("[replya]\nspeed = 2\n", 1, "replya", "unknown key (did you mean 'replay'?)"),
        (
            "[[engine.changes]]\nat = '5m'\nmax_num_seq = 3\n",
            3,
            "engine.changes.0.max_num_seq",
            "unknown key (did you mean 'max_num_seqs'?)",
        ),
    ],
)
def test_errors_name_file_line_and_key(tmp_path: Path, text: str, line: int, key: str, reason: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    err = info.value
    assert err.line == line
    assert err.key == key
    assert reason in err.reason
    assert reason != "unknown key" or err.reason == reason  # "bogus", "nope": no guess
    assert str(err).startswith(f"{path}:{line}: {key}: ")
    assert "\n" not in str(err)


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[run]\nname = 'ok'\nduration = = 3\n")
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert info.value.line == 3
    assert "TOML syntax" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        config.load(tmp_path / "absent.toml")


def test_criteria_can_be_switched_off(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, "[criteria]\nttft_p99_ms = false\n"))
    assert cfg.criteria.ttft_p99_ms is False
    with pytest.raises(ConfigError):
        config.load(write(tmp_path, "[criteria]\nttft_p99_ms = true\n"))


def test_overrides_apply_and_are_validated() -> None:
    cfg = config.load(None, {"run.duration": "8h", "replay.max_concurrency": 4})
    assert cfg.run.duration == 8 * 3600
    assert cfg.replay.max_concurrency == 4
    with pytest.raises(ConfigError) as info:
        config.load(None, {"replay.max_concurrency": 0})
    assert info.value.key == "replay.max_concurrency"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("10m", 600), ("8h", 28800), ("1h30m", 5400), ("250ms", 0.25), (12, 12), ("1d", 86400)],
)
def test_parse_duration(text: str | int, seconds: float) -> None:
    assert config.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "10", "m10", "10m5", "-5s", -1, True, [1]])
def test_parse_duration_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        config.parse_duration(bad)


def test_run_name_must_be_a_plain_word() -> None:
    with pytest.raises(ConfigError) as info:
        config.load(None, {"run.name": "a/b"})
    assert info.value.key == "run.name"


def test_replay_window_end_must_follow_start(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[replay]\nstart = "10m"\nend = "5m"\n')
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert str(info.value) == (
        f"{path}:3: replay.end: must be after replay.start (600 s), or 0 for the end of the trace"
    )
    assert config.load(path, {"replay.end": "20m"}).replay.end == 1200.0


def test_environment_overrides_in_the_settings_style(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nduration = "2m"\n[sinks.influx]\nurl = "http://file:8086"\n')
    env = {
        "SOAKD_RUN__DURATION": "8h",
        "SOAKD_SINKS__INFLUX__URL": "http://db:8086",
        "SOAKD_ENGINE__MAX_NUM_SEQS": "32",
        "SOAKD_CONFIG": "/etc/soakd/config.toml",  # not an override: no double underscore
        "SOAKD_INFLUX_TOKEN": "secret",
        "OTHER__RUN__DURATION": "1s",
    }
    cfg = config.load(path, env=env)
    assert (cfg.run.duration, cfg.sinks.influx.url, cfg.engine.max_num_seqs) == (
        28800.0,
        "http://db:8086",
        32,
    )
    # The command line wins over the environment, which wins over the file.
    assert config.load(path, {"run.duration": "1h"}, env=env).run.duration == 3600.0
    assert config.load(path).run.duration == 120.0


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("SOAKD_RUN__DURATON", "8h", "environment SOAKD_RUN__DURATON: run.duraton"),
        ("SOAKD_RUN__DURATION", "-5s", "environment SOAKD_RUN__DURATION: run.duration"),
        ("SOAKD_RUN____X", "1", "environment SOAKD_RUN____X: expected SOAKD_SECTION__KEY"),
        ("SOAKD_RUN__DURATION__X", "1", "environment SOAKD_RUN__DURATION__X: run.duration"),
    ],
)
def test_a_bad_environment_override_names_its_variable(name: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.load(None, env={name: value})
    assert str(info.value).startswith(says), str(info.value)
