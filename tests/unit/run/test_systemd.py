"""systemd/soakd.service and soakd-nightly.timer: systemd accepts them, the hardening scores well,
and the decisions the daemon relies on (notify, exit codes, restart and resume, kill mode, timeouts,
credentials) are in the file.

systemd is not PID 1 where these run, so the units are checked with `systemd-analyze` only.
Without systemd-analyze those checks skip, unless SOAKD_REQUIRE_SYSTEMD=1 (CI) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from soakd import config
from soakd.config import InfluxConfig, WebhookConfig

ROOT = Path(__file__).resolve().parents[3]
UNIT_DIR = ROOT / "systemd"
SERVICE = UNIT_DIR / "soakd.service"
TIMER = UNIT_DIR / "soakd-nightly.timer"
ENV_EXAMPLE = UNIT_DIR / "soakd.env.example"

# `systemd-analyze security --threshold=` takes the exposure on a 0..100 scale (systemd 252 rejects
# "4.0"): 40 is the 4.0 shown as "Overall exposure level". The unit scores 2.9 on systemd 252.
EXPOSURE_LIMIT = 4.0

Unit = dict[str, dict[str, list[str]]]


# ---------------------------------------------------------------------------------------------------
# a small unit-file parser: sections -> key -> every value in order (systemd keys may repeat;
# an empty assignment resets the list, as systemd does for list-valued settings)


def parse_unit(text: str) -> Unit:
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):  # continuation line
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=VALUE line: {raw!r}"
        values = section.setdefault(key.strip(), [])
        if value.strip():
            values.append(value.strip())
        else:
            values.clear()
    return unit


def one(unit: Unit, section: str, key: str) -> str:
    values = unit.get(section, {}).get(key, [])
    assert len(values) == 1, f"[{section}] {key}= should be set exactly once, got {values}"
    return values[0]


_SPAN_UNITS = {
    "us": 1e-6,
    "usec": 1e-6,
    "ms": 1e-3,
    "msec": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}


def timespan_s(text: str) -> float:
    """systemd time span ("20min", "5min 30s", "120") in seconds; a bare number is seconds."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]+)", text)
    assert parts and re.fullmatch(r"(\s*\d+(\.\d+)?\s*[a-z]+)+\s*", text), f"not a time span: {text!r}"
    total = 0.0
    for number, unit in parts:
        assert unit in _SPAN_UNITS, f"unknown time unit {unit!r} in {text!r}"
        total += float(number) * _SPAN_UNITS[unit]
    return total


def test_timespan_parser() -> None:
    assert timespan_s("20min") == 1200.0
    assert timespan_s("1h 5min 30s") == 3930.0
    assert timespan_s("120") == 120.0
    with pytest.raises(AssertionError):
        timespan_s("soon")


def test_parse_unit_keeps_repeats_and_resets_on_empty() -> None:
    unit = parse_unit("[S]\n# c\nA=1\nA=2\nB=x\nB=\nC=a \\\n  b\n")
    assert unit == {"S": {"A": ["1", "2"], "B": [], "C": ["a b"]}}


# ---------------------------------------------------------------------------------------------------
# the decisions in the unit (no systemd needed)


@pytest.fixture(scope="module")
def service() -> Unit:
    return parse_unit(SERVICE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def timer() -> Unit:
    return parse_unit(TIMER.read_text(encoding="utf-8"))


def test_service_is_type_notify_and_runs_soakd(service: Unit) -> None:
    assert one(service, "Service", "Type") == "notify"
    assert one(service, "Service", "NotifyAccess") == "main"  # vLLM's children inherit NOTIFY_SOCKET
    exec_start = one(service, "Service", "ExecStart").split()
    # --resume: a restart after a crash continues the run instead of starting a new one.
    assert exec_start == [
        *("/opt/soakd/venv/bin/soakd", "run", "--no-progress", "--resume"),
        # A service stop is a clean end (exit 0), not the CLI's default 4 (stopped: a cancelled CI job).
        *("--stopped-exit-code", "0"),
    ]
    env = service["Service"]["Environment"]
    assert "SOAKD_CONFIG=/etc/soakd/config.toml" in env
    assert one(service, "Service", "EnvironmentFile") == "-/etc/soakd/soakd.env"


def test_no_secrets_in_the_unit(service: Unit) -> None:
    names = {v.split("=", 1)[0].strip('"') for v in service["Service"].get("Environment", [])}
    assert not names & {"SOAKD_INFLUX_TOKEN", "SOAKD_INFLUX_PASSWORD", "HF_TOKEN"}


def test_exit_statuses_and_restart_on_failure(service: Unit) -> None:
    # FAIL (1) and an engine/sink error or a verdict the disk refused (3) leave the unit "failed", so
    # systemctl shows them.
    assert "SuccessExitStatus" not in service["Service"]
    prevent = " ".join(service["Service"]["RestartPreventExitStatus"]).split()
    assert "1" in prevent  # FAIL: the verdict is written, the soak is over
    assert "2" in prevent  # bad config: a restart cannot help
    assert "3" in prevent  # the run is over (a FAIL written, or none the disk took): no new full soak
    # A crash or watchdog kill is restarted and resumed; a stop (exit 0) and a verdict are not.
    assert one(service, "Service", "Restart") == "on-failure"
    assert 10 <= timespan_s(one(service, "Service", "RestartSec")) <= 300  # the GPU frees the old engine
    # An engine OOM kill is soakd's to judge, not a reason for systemd to stop the unit.
    assert one(service, "Service", "OOMPolicy") == "continue"


def test_a_crash_loop_ends_in_failed(service: Unit) -> None:
    # The start limit is a [Unit] setting.
    assert not {"StartLimitIntervalSec", "StartLimitBurst", "StartLimitInterval"} & set(service["Service"])
    interval = timespan_s(one(service, "Unit", "StartLimitIntervalSec"))
    burst = int(one(service, "Unit", "StartLimitBurst"))
    assert 2 <= burst <= 5  # at least one restart; a few at most
    # A loop in which every start fails only at TimeoutStartSec must still fill the window.
    per_start = timespan_s(one(service, "Service", "TimeoutStartSec")) + timespan_s(
        one(service, "Service", "RestartSec")
    )
    assert interval >= burst * per_start, f"{burst} starts of {per_start} s do not fit in {interval} s"
    assert interval <= 6 * 3600  # tomorrow's nightly start must not be refused
    resume_within = config.load(ROOT / "config.toml").run.resume_within
    assert timespan_s(one(service, "Service", "RestartSec")) < resume_within  # a restart still resumes


def test_load_credential_example_names_the_configured_variables() -> None:
    """The commented LoadCredential= lines name the credentials make_writer / make_sender look for by
    default."""
    examples = re.findall(r"^#LoadCredential=([^:\s]+):(\S+)$", SERVICE.read_text(encoding="utf-8"), re.M)
    names = {name for name, _ in examples}
    defaults = InfluxConfig()
    assert names == {defaults.token_env, defaults.password_env, WebhookConfig().token_env}
    assert all(path.startswith("/etc/soakd/") for _, path in examples)


def test_kill_mode_and_timeouts_fit_the_config(service: Unit) -> None:
    cfg = config.load(ROOT / "config.toml")
    assert one(service, "Service", "KillMode") == "mixed"
    start = timespan_s(one(service, "Service", "TimeoutStartSec"))
    assert start >= 15 * 60
    assert start > cfg.engine.start_timeout  # soakd gives up on the engine before systemd kills it
    stop = timespan_s(one(service, "Service", "TimeoutStopSec"))
    drain = (
        cfg.replay.drain_timeout
        + cfg.sinks.influx.final_drain_timeout
        + cfg.sinks.webhook.final_drain_timeout
    )
    assert stop >= drain + 60, f"TimeoutStopSec {stop} s leaves under a minute beyond the {drain} s drain"


def test_watchdog_is_set_and_generous(service: Unit) -> None:
    watchdog = timespan_s(one(service, "Service", "WatchdogSec"))
    assert 60 <= watchdog <= 600


def test_hardening_keeps_the_gpu_usable(service: Unit) -> None:
    svc = service["Service"]
    assert "MemoryDenyWriteExecute" not in svc  # torch/Triton JIT needs W+X memory
    assert "PrivateDevices" not in svc  # would hide /dev/nvidia*
    assert "SystemCallFilter" not in svc  # the CUDA driver's syscall set is undocumented
    assert "PrivateNetwork" not in svc and "IPAddressDeny" not in svc  # InfluxDB may be remote
    assert svc.get("ProcSubset", ["all"]) == ["all"]  # NVML reads /proc/driver/nvidia
    assert one(service, "Service", "DevicePolicy") == "closed"
    allowed = {v.split()[0] for v in svc["DeviceAllow"]}
    assert {
        "char-nvidia",
        "char-nvidia-frontend",
        "char-nvidia-uvm",
        "char-nvidia-caps",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools",
    } <= allowed
    assert all(v.split()[1:] == ["rw"] for v in svc["DeviceAllow"])
    families = " ".join(svc["RestrictAddressFamilies"]).split()
    assert set(families) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


def test_identity_state_and_hardening(service: Unit) -> None:
    svc = service["Service"]
    assert one(service, "Service", "User") == "soakd"
    assert one(service, "Service", "Group") == "soakd"
    assert svc.get("DynamicUser", ["no"]) == ["no"]
    assert one(service, "Service", "StateDirectory") == "soakd"
    assert one(service, "Service", "WorkingDirectory") == "/var/lib/soakd"
    assert one(service, "Service", "ProtectSystem") == "strict"
    assert one(service, "Service", "ProtectHome") == "yes"
    assert one(service, "Service", "UMask") == "0077"  # run folders, caches: the soakd user's alone
    assert "CapabilityBoundingSet" in svc
    assert svc["CapabilityBoundingSet"] == []  # present and empty: no capabilities
    for key in (
        "PrivateTmp",
        "PrivateUsers",
        "PrivateMounts",
        "RemoveIPC",
        "NoNewPrivileges",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "RestrictNamespaces",
        "LockPersonality",
        "RestrictRealtime",
    ):
        assert one(service, "Service", key) == "yes", key
    assert one(service, "Service", "SystemCallArchitectures") == "native"
    assert one(service, "Service", "LimitNOFILE") == "65536"


def test_service_cannot_be_enabled_on_its_own(service: Unit) -> None:
    # The timer starts soaks; an [Install] section would let `systemctl enable soakd` run one every boot.
    assert "Install" not in service


def test_timer_starts_the_service_nightly(timer: Unit) -> None:
    assert one(timer, "Timer", "OnCalendar") == "*-*-* 20:00:00"
    assert one(timer, "Timer", "Persistent") == "true"
    assert one(timer, "Timer", "Unit") == "soakd.service"
    assert one(timer, "Install", "WantedBy") == "timers.target"


def test_env_example_holds_no_values() -> None:
    lines = ENV_EXAMPLE.read_text(encoding="utf-8").splitlines()
    active = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert active == [], f"soakd.env.example must only hold commented examples, got {active}"
    text = "\n".join(lines)
    assert "#SOAKD_INFLUX_TOKEN=" in text
    assert "#SOAKD_INFLUX_PASSWORD=" in text
    assert "LoadCredential=SOAKD_INFLUX_TOKEN:" in text  # points at the better way


# ---------------------------------------------------------------------------------------------------
# systemd-analyze


@pytest.fixture(scope="module")
def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        reason = "systemd-analyze is not installed (set SOAKD_REQUIRE_SYSTEMD=1 to make this a failure)"
        if os.environ.get("SOAKD_REQUIRE_SYSTEMD") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def _run(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    env |= {"SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "cat", "LC_ALL": "C.UTF-8"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False)


_EXEC_LINE = re.compile(r"^(Exec[A-Za-z]*=)([-+!@:|]*)(\S+)(.*)$")


def verifiable_copy(unit: Path, dest: Path) -> Path:
    """The unit with every Exec*= binary that does not exist here replaced by this Python
    (verify insists that commands are executable); the rest of the file is unchanged."""
    out = []
    for line in unit.read_text(encoding="utf-8").splitlines():
        m = _EXEC_LINE.match(line)
        if m and not Path(m.group(3)).exists():
            exe = sys.executable if " " not in sys.executable else f'"{sys.executable}"'
            out.append(f"{m.group(1)}{m.group(2)}{exe} -c pass{m.group(4)}")
        else:
            out.append(line)
    copy = dest / unit.name
    copy.write_text("\n".join(out) + "\n", encoding="utf-8")
    return copy


def test_verifiable_copy_only_rewrites_missing_binaries(tmp_path: Path) -> None:
    copy = verifiable_copy(SERVICE, tmp_path)
    old = SERVICE.read_text(encoding="utf-8").splitlines()
    new = copy.read_text(encoding="utf-8").splitlines()
    changed = [(a, b) for a, b in zip(old, new, strict=True) if a != b]
    if Path("/opt/soakd/venv/bin/soakd").exists():
        assert changed == []
    else:
        assert len(changed) == 1
        assert changed[0][1].startswith("ExecStart=")
        assert changed[0][1].endswith(" run --no-progress --resume --stopped-exit-code 0")


def test_systemd_verify_is_silent(analyze: str, tmp_path: Path) -> None:
    service = verifiable_copy(SERVICE, tmp_path)
    timer = verifiable_copy(TIMER, tmp_path)
    res = _run([analyze, "verify", str(service), str(timer)], cwd=tmp_path)
    # Unknown keys, bad values and missing units only warn: any stderr line is a failure.
    assert res.stderr.strip() == "", res.stderr
    assert res.returncode == 0, res.stdout


def test_systemd_verify_accepts_the_load_credential_example(analyze: str, tmp_path: Path) -> None:
    """The commented example is valid as written: uncommented, as a drop-in sets it, verify is silent."""
    service = verifiable_copy(SERVICE, tmp_path)
    text = service.read_text(encoding="utf-8")
    assert "\n#LoadCredential=" in text
    service.write_text(text.replace("\n#LoadCredential=", "\nLoadCredential="), encoding="utf-8")
    res = _run([analyze, "verify", str(service)], cwd=tmp_path)
    assert res.stderr.strip() == "", res.stderr
    assert res.returncode == 0, res.stdout


def test_systemd_verify_would_catch_a_bad_key(analyze: str, tmp_path: Path) -> None:
    """The check above means something: this systemd-analyze reports an unknown key on stderr."""
    service = verifiable_copy(SERVICE, tmp_path)
    service.write_text(
        service.read_text(encoding="utf-8").replace("[Service]\n", "[Service]\nMemoryDenyWriteExec=no\n"),
        encoding="utf-8",
    )
    res = _run([analyze, "verify", str(service)], cwd=tmp_path)
    assert "MemoryDenyWriteExec" in res.stderr


def test_security_exposure_below_threshold(analyze: str, tmp_path: Path) -> None:
    service = verifiable_copy(SERVICE, tmp_path)
    res = _run(
        [
            analyze,
            "security",
            "--offline=true",
            f"--threshold={round(EXPOSURE_LIMIT * 10)}",
            "--no-pager",
            str(service),
        ],
        cwd=tmp_path,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m, f"no exposure level in the output:\n{res.stdout}\n{res.stderr}"
    exposure = float(m.group(1))
    print(f"soakd.service exposure: {exposure}")
    assert exposure <= EXPOSURE_LIMIT, res.stdout
    assert res.returncode == 0, res.stderr


def test_security_threshold_would_catch_a_weaker_unit(analyze: str, tmp_path: Path) -> None:
    """The threshold check above means something: the unit without its sandbox scores above it."""
    service = verifiable_copy(SERVICE, tmp_path)
    kept = [
        line
        for line in service.read_text(encoding="utf-8").splitlines()
        if not line.startswith(("Protect", "Private", "Restrict", "Capability", "NoNew", "Device"))
    ]
    service.write_text("\n".join(kept) + "\n", encoding="utf-8")
    res = _run(
        [analyze, "security", "--offline=true", f"--threshold={round(EXPOSURE_LIMIT * 10)}", str(service)],
        cwd=tmp_path,
    )
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert m and float(m.group(1)) > EXPOSURE_LIMIT, res.stdout
    assert res.returncode != 0


def test_timer_calendar_is_valid(analyze: str, timer: Unit) -> None:
    spec = one(timer, "Timer", "OnCalendar")
    res = _run([analyze, "calendar", spec])
    assert res.returncode == 0, res.stderr
    assert "Normalized form: *-*-* 20:00:00" in res.stdout
    assert re.search(r"Next elapse: .* 20:00:00", res.stdout), res.stdout


def test_calendar_check_rejects_nonsense(analyze: str) -> None:
    assert _run([analyze, "calendar", "every evening"]).returncode != 0
