"""Special and hostile files as config or trace, through the real CLI in a child process: each is refused
by type or by size before it is read whole (exit 2, one line naming the file), in seconds, with the
child's peak RSS measured (< 500 MB), where before a FIFO hung forever and /dev/zero or a gzip bomb
exhausted memory."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from soakd.testing import PEAK_RSS_LIMIT_MB, PeakRss, measured

PEAK_RSS_BYTES = PEAK_RSS_LIMIT_MB << 20


def _run(
    argv: list[str], cwd: Path, timeout_s: float = 60.0, extra_env: dict[str, str] | None = None
) -> tuple[int, str, int]:
    """(exit code, stderr, peak RSS in bytes) of `python -m soakd ARGV`, run in `cwd` (with `extra_env`
    set) and killed by its process group on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("SOAKD_CONFIG", "JOURNAL_STREAM")}
    env.update(extra_env or {})
    rss_file = cwd.parent / f"{cwd.name}.maxrss"
    rss_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        measured([sys.executable, "-m", "soakd", *argv], rss_file),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        _, err_bytes = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"soakd {' '.join(argv)} still running after {timeout_s:.0f} s")
    rss = int(PeakRss.read(rss_file).mb * 2**20)
    rss_file.unlink()
    return proc.returncode, err_bytes.decode("utf-8", "replace"), rss


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _loop(path: Path) -> Path:
    path.symlink_to(path.name)  # points at itself
    return path


def _dev_zero(path: Path) -> Path:
    path.symlink_to("/dev/zero")
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _big_config(path: Path) -> Path:
    path.write_text("# padding\n" * 200_000)  # 2 MB of comments: valid TOML, not a config
    return path


def _gzip_bomb(path: Path) -> Path:
    with gzip.open(path, "wb", compresslevel=9) as f:  # 64 MiB of zeros, no newline: ~64 kB stored
        chunk = b"0" * (1 << 20)
        for _ in range(64):
            f.write(chunk)
    return path


def _long_line(path: Path) -> Path:
    path.write_bytes(
        b'{"format": "soakd-trace", "version": 1, "block_size": 16, "x": "' + b"a" * (20 << 20) + b'"}\n'
    )
    return path


def _huge_block_size(path: Path) -> Path:
    header = '{"format": "soakd-trace", "version": 1, "block_size": 1000000000}'
    path.write_text(header + '\n{"t": 0, "input_tokens": 9, "output_tokens": 1}\n')
    return path


def _deep_config(path: Path) -> Path:
    path.write_text("a = " + "[" * 5000 + "\n")  # tomllib recurses once per level
    return path


CONFIGS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("fifo", _fifo, "a FIFO, not a regular file"),
    ("symlink-loop", _loop, "a symlink loop"),
    ("dev-zero", _dev_zero, "a character device, not a regular file"),
    ("folder", _folder, "a directory, not a regular file"),
    ("two-megabytes", _big_config, "larger than 1 MiB"),
    ("nested-5000-deep", _deep_config, "TOML nested deeper than the parser goes"),
]


@pytest.mark.parametrize(("kind", "make", "reason"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_special_or_huge_config_is_refused(
    tmp_path: Path, kind: str, make: Callable[[Path], Path], reason: str
) -> None:
    path = make(tmp_path / "c.toml")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err, rss = _run(["check", "--config", "c.toml"], tmp_path)
    expected = (
        f"c.toml: {reason}: not a soakd config"
        if kind in ("two-megabytes", "nested-5000-deep")
        else f"c.toml: cannot read: {reason}"
    )
    assert code == 2 and err == f"soakd: error: {expected}\n", err
    assert rss < PEAK_RSS_BYTES and sorted(p.name for p in tmp_path.iterdir()) == before
    assert path.name in before


def test_a_set_value_nested_past_the_parser_is_refused(tmp_path: Path) -> None:
    code, err, _ = _run(["run", "--set", "replay.speed=" + "[" * 5000], tmp_path)
    assert code == 2 and err.endswith(
        "argument --set: replay.speed: value nested deeper than the parser goes\n"
    ), err[-2000:]
    assert "Traceback" not in err


TRACES: list[tuple[str, str, Callable[[Path], Path], str]] = [
    ("fifo", "t.jsonl", _fifo, "cannot read: a FIFO, not a regular file"),
    ("symlink-loop", "t.jsonl", _loop, "cannot read: a symlink loop"),
    ("dev-zero", "t.jsonl", _dev_zero, "cannot read: a character device, not a regular file"),
    ("folder", "t.jsonl", _folder, "cannot read: a directory, not a regular file"),
    ("gzip-bomb", "t.jsonl.gz", _gzip_bomb, "line longer than 16 MiB"),
    ("long-line", "t.jsonl", _long_line, "line longer than 16 MiB"),
    ("huge-block-size", "t.jsonl", _huge_block_size, "block_size: must be <= 65536"),
]
# Detection reads the first 64 kB only: a file of one endless line is "cannot tell the format" there,
# and "line longer than" once its format is given.
_UNDETECTED = "cannot tell the format from the first row"


@pytest.mark.parametrize(("kind", "name", "make", "reason"), TRACES, ids=[t[0] for t in TRACES])
def test_a_special_or_hostile_trace_is_refused(
    tmp_path: Path, kind: str, name: str, make: Callable[[Path], Path], reason: str
) -> None:
    make(tmp_path / name)
    endless = kind in ("gzip-bomb", "long-line")
    for argv in (["trace", "inspect", name, "--format", "native"], ["check", "--trace", name]):
        code, err, rss = _run(argv, tmp_path)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, err[-2000:])
        assert err.startswith(f"soakd: error: {tmp_path / name}"), err
        assert reason in err or (endless and argv[0] == "check" and _UNDETECTED in err), err
        assert rss < PEAK_RSS_BYTES, (argv, rss >> 20)


def _big_credential(path: Path) -> Path:
    path.write_bytes(b"x" * (65 << 10))
    return path


CREDENTIALS: list[tuple[str, Callable[[Path], Path], str]] = [
    ("fifo", _fifo, "cannot read: a FIFO, not a regular file"),
    ("symlink-loop", _loop, "cannot read: a symlink loop"),
    ("dev-zero", _dev_zero, "cannot read: a character device, not a regular file"),
    ("folder", _folder, "cannot read: a directory, not a regular file"),
    ("sixty-five-kib", _big_credential, "larger than 64 KiB: not a credential"),
]
# An engine that is only a URL (nothing to load), InfluxDB shipping on: its token is read at start.
_RUN_CONFIG = """
[engine]
kind = "openai"
url = "http://127.0.0.1:9"

[sinks.influx]
enabled = true
api = "v2"
"""


@pytest.mark.parametrize(("kind", "make", "reason"), CREDENTIALS, ids=[c[0] for c in CREDENTIALS])
def test_a_special_or_huge_credential_is_refused_before_anything_is_written(
    tmp_path: Path, kind: str, make: Callable[[Path], Path], reason: str
) -> None:
    (tmp_path / "c.toml").write_text(_RUN_CONFIG)
    creds = tmp_path / "credentials"
    creds.mkdir()
    token = make(creds / "SOAKD_INFLUX_TOKEN")
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err, rss = _run(
        ["run", "--config", "c.toml", "--trace", "bundled:demo"],
        tmp_path,
        timeout_s=30.0,
        extra_env={"CREDENTIALS_DIRECTORY": str(creds)},
    )
    assert code == 2 and err == (f"soakd: error: sinks.influx.token_env: credential {token}: {reason}\n"), (
        err[-2000:]
    )
    assert rss < PEAK_RSS_BYTES, rss >> 20
    # Nothing half-made: no output folder (runs/), no run in it.
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    ("target", "key", "refused"),
    [
        ("http://user:pw-Zq9secret@127.0.0.1:9", "sk-Zq9apikey", True),
        ("http://user:pw-Zq9secret@127.0.0.1:9", "", False),  # the default variable, empty: no key
        ("http://127.0.0.1:9", "sk-Zq9apikey", False),
    ],
    ids=["userinfo-and-key", "userinfo-only", "key-only"],
)
def test_credentials_in_the_url_and_an_api_key_are_refused_before_anything_is_written(
    tmp_path: Path, target: str, key: str, refused: bool
) -> None:
    # Where both are given the run is refused in one line naming both, never showing either; one alone
    # passes this check (and then fails later, on the port nobody listens on, with exit 3).
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err, _ = _run(
        ["run", "--target", target, "--trace", "bundled:demo", "--set", "engine.start_timeout=1s"],
        tmp_path,
        timeout_s=60.0,
        extra_env={"SOAKD_OPENAI_API_KEY": key},
    )
    assert "Zq9" not in err and "Traceback" not in err, err[-2000:]
    if refused:
        assert code == 2 and err.count("\n") == 1, err[-2000:]
        assert "engine.url: credentials in the URL (http://<redacted>@127.0.0.1:9)" in err, err
        assert "$SOAKD_OPENAI_API_KEY" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    else:
        assert code != 2 and "Cannot combine" not in err, err[-2000:]
