"""soakd.notify against real AF_UNIX datagram sockets, as systemd's $NOTIFY_SOCKET would be."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from soakd.notify import notify, watchdog_interval_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sd_notify is Linux-only")

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL


@pytest.fixture
def sock_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short folder under /tmp when tmp_path is too long for a socket address."""
    if len(str(tmp_path / "notify.sock")) <= _SUN_PATH_MAX:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="sdn"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def listener(sock_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(sock_dir / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        # Like systemd: ask the kernel to attach the sender's pid/uid/gid to every datagram.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(5.0)
        yield sock, path


def _receive(sock: socket.socket) -> tuple[bytes, int | None]:
    """One datagram and the sender's pid from SCM_CREDENTIALS (None when the kernel sent none)."""
    creds_size = struct.calcsize("3i")
    data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(creds_size))
    pid = None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid, _uid, _gid = struct.unpack("3i", payload[:creds_size])
    return data, pid


def _assert_nothing_more(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


def test_sends_one_datagram_to_a_path_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify("READY=1\nSTATUS=x", env={"NOTIFY_SOCKET": path}) is True
    data, pid = _receive(sock)
    assert data == b"READY=1\nSTATUS=x"
    # NotifyAccess=main accepts only datagrams whose credentials name the main pid: this process.
    assert pid == os.getpid()
    _assert_nothing_more(sock)


def test_each_call_is_its_own_datagram(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    env = {"NOTIFY_SOCKET": path}
    assert notify("STATUS=replaying 12%", env=env)
    assert notify("WATCHDOG=1", env=env)
    assert _receive(sock)[0] == b"STATUS=replaying 12%"
    assert _receive(sock)[0] == b"WATCHDOG=1"
    _assert_nothing_more(sock)


def test_status_text_is_sent_as_utf8(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    assert notify("STATUS=done: PASS ✓", env={"NOTIFY_SOCKET": path})
    assert _receive(sock)[0].decode("utf-8") == "STATUS=done: PASS ✓"


def test_abstract_namespace_socket() -> None:
    name = f"soakd-test-{os.getpid()}-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5.0)
        assert notify("READY=1\nSTATUS=x", env={"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(4096) == b"READY=1\nSTATUS=x"
    # Nobody bound to that abstract name any more.
    assert notify("READY=1", env={"NOTIFY_SOCKET": "@" + name}) is False


def test_reads_notify_socket_from_os_environ(
    listener: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = listener
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert notify("STOPPING=1") is True
    assert _receive(sock)[0] == b"STOPPING=1"


@pytest.mark.parametrize("env", [{}, {"NOTIFY_SOCKET": ""}], ids=["unset", "empty"])
def test_false_without_notify_socket(env: dict[str, str]) -> None:
    assert notify("READY=1", env=env) is False


def test_false_without_notify_socket_in_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


def test_false_when_the_path_does_not_exist(sock_dir: Path) -> None:
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(sock_dir / "absent.sock")}) is False


def test_false_when_nothing_listens_on_a_stale_socket(sock_dir: Path) -> None:
    path = sock_dir / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
    assert path.exists()  # the socket file stays, its reader is gone: ECONNREFUSED
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(path)}) is False


def test_false_when_the_path_is_not_a_socket(sock_dir: Path) -> None:
    path = sock_dir / "plain-file"
    path.write_text("", encoding="utf-8")
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(path)}) is False


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000"}) == 60.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": str(os.getpid())}) == 60.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "3000000"}) == 1.5


def test_watchdog_meant_for_another_process_is_ignored() -> None:
    # A child that inherited its parent's environment must not send WATCHDOG=1 on the parent's behalf.
    other = os.getppid()
    assert other != os.getpid()
    assert watchdog_interval_s({"WATCHDOG_USEC": "120000000", "WATCHDOG_PID": str(other)}) is None


@pytest.mark.parametrize(
    "env",
    [{}, {"WATCHDOG_USEC": ""}, {"WATCHDOG_USEC": "soon"}, {"WATCHDOG_USEC": "-5"}],
    ids=["missing", "empty", "not-a-number", "negative"],
)
def test_no_watchdog(env: dict[str, str]) -> None:
    assert watchdog_interval_s(env) is None


def test_watchdog_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 60.0
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None
