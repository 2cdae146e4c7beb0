"""InfluxDB secrets from systemd credentials (LoadCredential=) or the environment (EnvironmentFile=).

A credential is a file named like the environment variable the config names (token_env / password_env)
in $CREDENTIALS_DIRECTORY; it wins over the variable. The value never appears in a log line or an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from soakd import files
from soakd.config import InfluxConfig
from soakd.errors import ConfigError
from soakd.sinks import influx
from soakd.sinks.influx import read_secret

SECRET = "s3cr3t-t0ken"


class Captured:
    """Stands in for V1Writer / V2Writer: keeps what make_writer passed."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).calls.append((args, kwargs))


@pytest.fixture
def writers(monkeypatch: pytest.MonkeyPatch) -> tuple[type[Captured], type[Captured]]:
    v1 = type("V1", (Captured,), {"calls": []})
    v2 = type("V2", (Captured,), {"calls": []})
    monkeypatch.setattr(influx, "V1Writer", v1)
    monkeypatch.setattr(influx, "V2Writer", v2)
    return v1, v2


def creds(tmp_path: Path, **files: bytes) -> Path:
    directory = tmp_path / "credentials"
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return directory


def test_credential_file_is_read_and_one_line_break_stripped(tmp_path: Path) -> None:
    d = creds(tmp_path, A=b"tok\n", B=b"tok\r\n", C=b"tok", D=b"tok\n\n", E=b"", F=b" tok \n")
    env = {"CREDENTIALS_DIRECTORY": str(d)}
    got = {n: read_secret(n, env, key="k") for n in "ABCDEF"}
    assert got == {"A": "tok", "B": "tok", "C": "tok", "D": "tok\n", "E": "", "F": " tok "}


def test_credential_wins_over_the_environment_variable(tmp_path: Path) -> None:
    d = creds(tmp_path, SOAKD_INFLUX_TOKEN=SECRET.encode() + b"\n")
    env = {"CREDENTIALS_DIRECTORY": str(d), "SOAKD_INFLUX_TOKEN": "from-env"}
    with capture_logs() as logs:
        assert read_secret("SOAKD_INFLUX_TOKEN", env, key="k") == SECRET
    # Both set is worth a warning (an old EnvironmentFile line left behind), naming no value.
    assert [e["event"] for e in logs] == ["influx_secret_from_credential"]
    assert SECRET not in repr(logs) and "from-env" not in repr(logs)


def test_environment_variable_when_there_is_no_credential(tmp_path: Path) -> None:
    d = creds(tmp_path, OTHER=b"x")
    assert read_secret("SOAKD_INFLUX_TOKEN", {"SOAKD_INFLUX_TOKEN": "e"}, key="k") == "e"
    with_dir = {"CREDENTIALS_DIRECTORY": str(d), "SOAKD_INFLUX_TOKEN": "e"}
    assert read_secret("SOAKD_INFLUX_TOKEN", with_dir, key="k") == "e"
    assert read_secret("SOAKD_INFLUX_TOKEN", {"CREDENTIALS_DIRECTORY": str(d)}, key="k") == ""
    assert read_secret("SOAKD_INFLUX_TOKEN", {}, key="k") == ""
    # A directory that does not exist (a stale variable) is no credential either.
    gone = {"CREDENTIALS_DIRECTORY": str(tmp_path / "gone"), "SOAKD_INFLUX_TOKEN": "e"}
    assert read_secret("SOAKD_INFLUX_TOKEN", gone, key="k") == "e"


def test_names_that_are_not_one_file_name_never_leave_the_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("not for soakd")
    d = creds(tmp_path)
    env = {"CREDENTIALS_DIRECTORY": str(d)}
    for name in ("../outside", str(outside), ".", "..", ""):
        assert read_secret(name, env | {name: "e"}, key="k") == "e"


def test_unreadable_credential_is_a_config_error_without_the_value(tmp_path: Path) -> None:
    d = creds(tmp_path)
    (d / "SOAKD_INFLUX_TOKEN").mkdir()  # reading it fails the same way for root and others
    env = {"CREDENTIALS_DIRECTORY": str(d), "SOAKD_INFLUX_TOKEN": SECRET}
    with pytest.raises(ConfigError) as info:
        read_secret("SOAKD_INFLUX_TOKEN", env, key="sinks.influx.token_env")
    message = str(info.value)
    assert message.startswith("sinks.influx.token_env: credential ")
    assert str(d / "SOAKD_INFLUX_TOKEN") in message
    assert SECRET not in message


def test_undecodable_credential_error_quotes_no_byte_of_it(tmp_path: Path) -> None:
    d = creds(tmp_path, SOAKD_INFLUX_TOKEN=b"abc\xffdef")
    with pytest.raises(ConfigError) as info:
        read_secret("SOAKD_INFLUX_TOKEN", {"CREDENTIALS_DIRECTORY": str(d)}, key="k")
    message = str(info.value)
    assert "not UTF-8" in message
    assert not any(part in message for part in ("abc", "def", "ff"))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_permission_denied_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = creds(tmp_path, SOAKD_INFLUX_PASSWORD=SECRET.encode())

    def denied(path: Path, max_bytes: int) -> bytes:  # as for a non-root user and a mode 0400 root file
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(files, "read_bounded", denied)
    with pytest.raises(ConfigError, match="Permission denied") as info:
        read_secret("SOAKD_INFLUX_PASSWORD", {"CREDENTIALS_DIRECTORY": str(d)}, key="k")
    assert SECRET not in str(info.value)


def test_make_writer_v2_token_from_credential(
    tmp_path: Path, writers: tuple[type[Captured], type[Captured]]
) -> None:
    _, v2 = writers
    d = creds(tmp_path, SOAKD_INFLUX_TOKEN=SECRET.encode() + b"\n")
    env = {"CREDENTIALS_DIRECTORY": str(d), "SOAKD_INFLUX_TOKEN": "from-env"}
    influx.make_writer(InfluxConfig(api="v2", database="d", org="o"), env)
    (args, _kwargs) = v2.calls[-1]
    assert args[3] == SECRET  # url, org, bucket, token


def test_make_writer_v1_password_and_configured_names(
    tmp_path: Path, writers: tuple[type[Captured], type[Captured]]
) -> None:
    v1, _ = writers
    d = creds(tmp_path, INFLUX_PW=b"pw-from-credential\n")
    cfg = InfluxConfig(api="v1", username="u", password_env="INFLUX_PW")
    influx.make_writer(cfg, {"CREDENTIALS_DIRECTORY": str(d)})
    assert v1.calls[-1][1]["password"] == "pw-from-credential"
    influx.make_writer(cfg, {"INFLUX_PW": "pw-from-env"})
    assert v1.calls[-1][1]["password"] == "pw-from-env"


def test_make_writer_v2_user_password_fallback_reads_the_password_credential(
    tmp_path: Path, writers: tuple[type[Captured], type[Captured]]
) -> None:
    _, v2 = writers
    d = creds(tmp_path, SOAKD_INFLUX_PASSWORD=b"pw\n")
    cfg = InfluxConfig(api="v2", database="d", retention_policy="rp", username="u")
    influx.make_writer(cfg, {"CREDENTIALS_DIRECTORY": str(d)})
    assert v2.calls[-1][0][2:4] == ("d/rp", "u:pw")


def test_make_writer_reads_only_the_secrets_its_api_uses(
    tmp_path: Path, writers: tuple[type[Captured], type[Captured]]
) -> None:
    # An unreadable password credential does not matter to a v2 writer that has its token.
    d = creds(tmp_path, SOAKD_INFLUX_TOKEN=b"t")
    (d / "SOAKD_INFLUX_PASSWORD").mkdir()
    env = {"CREDENTIALS_DIRECTORY": str(d)}
    influx.make_writer(InfluxConfig(api="v2", username="u"), env)
    assert writers[1].calls[-1][0][3] == "t"
    with pytest.raises(ConfigError, match=r"sinks\.influx\.password_env"):
        influx.make_writer(InfluxConfig(api="v1", username="u"), env)


async def test_real_writer_gets_the_credential(tmp_path: Path) -> None:
    """Without stand-ins: the v2 client carries the token from the credential file."""
    d = creds(tmp_path, SOAKD_INFLUX_TOKEN=SECRET.encode())
    writer = influx.make_writer(InfluxConfig(api="v2"), {"CREDENTIALS_DIRECTORY": str(d)})
    assert isinstance(writer, influx.V2Writer)
    try:
        assert writer._client.token == SECRET
    finally:
        await writer.aclose()
