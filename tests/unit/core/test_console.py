"""The console stays soakd's: once detached, what the engine's code and its child processes write to
descriptors 1 and 2 lands in the engine log, and soakd's own lines and faulthandler stay on the console."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import faulthandler, os, subprocess, sys, warnings
    from pathlib import Path
    from soakd import console
    from soakd.logs import configure
    configure("info", fmt="json")
    faulthandler.enable()
    assert console.detach()
    print("soakd stdout before")
    print("soakd stderr before", file=sys.stderr)
    assert console.route_engine_output(Path(sys.argv[1]))
    # The engine: a child process that inherits descriptors 1 and 2, C-level writes, a library warning.
    child = "import sys; print('child out'); print('child err', file=sys.stderr)"
    subprocess.run([sys.executable, "-c", child])
    os.write(2, b"native write to fd 2\\n")
    print("vllm logger line", file=sys.__stderr__, flush=True)
    warnings.warn("torch.distributed.reduce_op is deprecated", FutureWarning)
    print("soakd stderr during", file=sys.stderr)
    print('{"json": "result"}')
    console.restore()
    os.write(2, b"native after restore\\n")
    faulthandler.dump_traceback(file=sys.stderr)
    """
)


def test_engine_output_goes_to_the_engine_log_and_soakd_keeps_the_console(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["soakd stdout before", '{"json": "result"}']
    err = proc.stderr
    assert "soakd stderr before" in err and "soakd stderr during" in err and "native after restore" in err
    assert '"event": "engine_output"' in err  # soakd says where the engine's output went
    assert "Current thread" in err  # faulthandler writes to the console, not the engine log
    for foreign in ("child out", "child err", "native write to fd 2", "vllm logger line", "FutureWarning"):
        assert foreign not in err and foreign not in proc.stdout
    engine = log.read_text()
    for line in ("child out", "child err", "native write to fd 2", "vllm logger line", "FutureWarning"):
        assert line in engine
    assert "soakd stderr" not in engine and log.stat().st_mode & 0o777 == 0o600


def test_without_real_descriptors_nothing_is_moved(tmp_path: Path) -> None:
    script = (
        "import io, sys; from pathlib import Path; from soakd import console; "
        "sys.stderr = io.StringIO(); "
        "assert not console.detach(); assert not console.route_engine_output(Path(sys.argv[1])); "
        "console.restore()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "x.log")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "x.log").exists()
