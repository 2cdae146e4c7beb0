"""systemd's notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1): one datagram to $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` to the service manager; False when not run under systemd (or it is not listening)."""
    addr = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """Half of systemd's WATCHDOG_USEC (how often to send WATCHDOG=1), or None when no watchdog is set."""
    e = env if env is not None else os.environ
    usec = e.get("WATCHDOG_USEC", "")
    pid = e.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6
