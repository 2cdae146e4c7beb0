"""Files soakd writes and reads: private run files (0600 whatever the umask, replaced atomically) in
strict JSON, and the type check every input file passes before it is opened."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import threading
from pathlib import Path
from typing import Any

from soakd.errors import InputError

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_regular_file(path: Path) -> str | None:
    """Why `path` cannot be read as an input file (a FIFO would block forever, /dev/zero never ends, a
    directory or a symlink loop has no content), or None for a regular file (through symlinks) and for a
    missing one (the caller's open says so in its own words)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symlink loop"
        return None
    return _mode_kind(mode)


def _mode_kind(mode: int) -> str | None:
    """What a file of `mode` is when it is not a regular file ("a FIFO, not a regular file"...), or None."""
    if stat.S_ISREG(mode):
        return None
    for test, kind in _KINDS:
        if test(mode):
            return f"{kind}, not a regular file"
    return "not a regular file"


class NotRegularFile(OSError):
    """A file refused by a check on its open descriptor or by O_NOFOLLOW (a FIFO, a device, a directory;
    a run file that is a symlink): its target never read or written; `strerror` says what it is."""


def lstat_kind(path: Path) -> str | None:
    """What `path` itself is when it is not a regular file ("a symlink", "a FIFO, not a regular file"...),
    or None for a regular file and a missing one. Links are not followed: a run folder's files are
    soakd's own, a link there points at something soakd did not write."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return None
    return "a symlink" if stat.S_ISLNK(mode) else _mode_kind(mode)


def open_no_follow(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor on `path` itself, never on a link's target: a symlink is refused by the open
    (O_NOFOLLOW), anything but a regular file by a check on the opened file (so a swap between a check
    and the open is caught too); each refusal a NotRegularFile. A missing file is FileNotFoundError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, not followed", str(path)) from None
        if err.errno in (errno.EISDIR, errno.ENXIO):
            raise NotRegularFile(err.errno, "not a regular file", str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
        # O_NONBLOCK only kept a FIFO from blocking the open; a regular file's writes are plain ones.
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_no_follow(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of the regular file `path` itself (open_no_follow's refusals), at most `max_bytes` + 1."""
    with os.fdopen(open_no_follow(path), "rb") as fh:
        return fh.read() if max_bytes is None else fh.read(max_bytes + 1)


def read_json_no_follow(path: Path) -> Any:
    """The JSON in a run folder's own file `path` (read_no_follow): OSError when it is missing, a link or
    not a regular file; ValueError when it is not UTF-8 JSON."""
    return json.loads(read_no_follow(path).decode("utf-8"))


def write_private(path: Path, data: bytes, *, fsync: bool = False) -> None:
    """Replace `path` with `data` so a reader sees the old or the whole new content, never half; the
    file is created 0600 (its directory decides who may reach it)."""
    # Per process and thread: a file written from a worker thread and the event loop at once (a
    # checkpoint) must not share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def open_private_append(path: Path) -> int:
    """A file descriptor appending to `path`, created 0600 if new; never through a symlink, never to
    anything but a regular file (open_no_follow)."""
    return open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def json_text(data: Any, **kwargs: Any) -> str:
    """JSON that every parser reads: a NaN or infinity (a figure that could not be measured, such as a
    percentile of nothing) becomes null, never Python's bare NaN / Infinity tokens."""
    return json.dumps(_finite(data), allow_nan=False, **kwargs)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write strict JSON so that a reader sees the old file or the whole new one, never half of it;
    0600 and fsynced, as every run file."""
    write_private(path, (json_text(data, indent=2, sort_keys=True, default=str) + "\n").encode(), fsync=True)


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """At most `max_bytes + 1` bytes of the regular file `path` (more than `max_bytes`: too large).

    Opened non-blocking (a FIFO opens at once instead of waiting for a writer) and checked on the open
    descriptor (no race with a swap after a check by name): anything but a regular file raises
    NotRegularFile saying what it is; a symlink is followed (systemd credentials and mounted secrets are
    often links), a symlink loop raises OSError(ELOOP)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        kind = _mode_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotRegularFile(errno.EINVAL, kind)
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _reason(err: OSError) -> str:
    if isinstance(err, NotRegularFile):
        return str(err.strerror)
    if err.errno == errno.ELOOP:
        return "a symlink loop"
    return err.strerror or type(err).__name__


MAX_CREDENTIAL_BYTES = 64 << 10
"""A credential (a token, a password) is a line; 64 KiB holds any, and bounds what a wrong path costs."""


def read_credential(path: Path, error: type[InputError], *, key: str) -> str | None:
    """The text of the credential file `path` (a trailing line break dropped), or None when it does not
    exist; every other failure (not a regular file: a FIFO, /dev/zero, a directory; a symlink loop;
    larger than 64 KiB; not UTF-8; unreadable) is an `error` naming the file and the config `key`,
    never quoting the content."""
    try:
        raw = read_bounded(path, MAX_CREDENTIAL_BYTES)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise error(f"credential {path}: cannot read: {_reason(err)}", key=key) from None
    if len(raw) > MAX_CREDENTIAL_BYTES:
        raise error(
            f"credential {path}: larger than {MAX_CREDENTIAL_BYTES >> 10} KiB: not a credential", key=key
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        # `from None`: the decode error quotes the offending bytes.
        raise error(f"credential {path}: not UTF-8 text", key=key) from None
    # A file written with `echo` or an editor ends in a line break that is not part of the secret.
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def read_input_text(
    path: Path, max_bytes: int, what: str, error: type[InputError], *, follow: bool = True
) -> str:
    """The UTF-8 text of a small input file read whole (a config, a run's JSON): refused by type before
    it is opened, and past `max_bytes` before it is held, each refusal an `error` naming the file.
    `follow=False` (a run folder's files) refuses a symlink too, never reading its target."""
    kind = not_a_regular_file(path) if follow else lstat_kind(path)
    if kind is not None:
        raise error(f"cannot read: {kind}", file=path)
    try:
        raw = read_bounded(path, max_bytes) if follow else read_no_follow(path, max_bytes)
    except OSError as err:
        # Swapped for a FIFO or a device since the check by name: refused on the descriptor, not hung.
        raise error(f"cannot read: {_reason(err)}", file=path) from None
    if len(raw) > max_bytes:
        raise error(f"larger than {max_bytes >> 20} MiB: not {what}", file=path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error("not UTF-8 text", file=path) from None
