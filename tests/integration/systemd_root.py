"""A real systemd, booted as PID 1 in its own Debian root, for testing soakd's units for real.

The root is a minimal Debian 12 made by debootstrap, with a venv at /opt/soakd/venv holding soakd's
dependencies, built once and cached (keyed by the package list and pyproject's dependencies). Each
machine boots an overlay of it (its writes go to a throw-away upper folder), pivot_root'ed into, in new
PID, mount, UTS and IPC namespaces: never the host's own root, whose /tmp systemd's boot-time cleaning
would empty. The network namespace is the host's, so the service reaches servers the test runs on
loopback. The root is made shared, as systemd-nspawn does, so mounts made for a service reach PID 1.

The machine gets its own /dev (a tmpfs with the harmless nodes bound in), /proc/sys and /sys read-only
(so no boot service changes the host's kernel settings) and, in every cgroup hierarchy, a subtree of its
own that systemd takes as its root and that is removed at power-off.

    python tests/integration/systemd_root.py build     # builds (or finds) the cached root, prints its path
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SOAKD_SYSTEMD_ROOT_CACHE", REPO / ".cache" / "systemd-root"))
SUITE = "bookworm"
MIRROR = os.environ.get("SOAKD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# systemd and its bus; python3-venv for the README's `python3.11 -m venv /opt/soakd/venv`.
PACKAGES = ("systemd", "systemd-sysv", "dbus", "python3", "python3-venv")
VENV = "/opt/soakd/venv"
CGROUP_ROOT = Path("/sys/fs/cgroup")


class HarnessError(RuntimeError):
    """The root could not be built or the machine did not boot; the message holds the evidence."""


def unavailable() -> str | None:
    """Why a machine cannot be booted here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts, cgroups)"
    for tool in ("unshare", "nsenter", "debootstrap", "chroot"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} not found (apt-get install debootstrap util-linux)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "no overlay filesystem in this kernel"
    probe = subprocess.run(
        ["unshare", "--pid", "--mount", "--uts", "--ipc", "--fork", "true"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return f"cannot make namespaces: {probe.stderr.decode(errors='replace').strip()}"
    return None


def _run(argv: Sequence[str], timeout_s: float = 900.0, **kw: object) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, **kw)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise HarnessError(
            f"{' '.join(argv[:6])}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}"
        )
    return str(done.stdout)


def _dependencies() -> list[str]:
    with (REPO / "pyproject.toml").open("rb") as f:
        deps: list[str] = tomllib.load(f)["project"]["dependencies"]
    return deps


def build_root() -> Path:
    """The cached Debian root with soakd's dependencies in /opt/soakd/venv and the soakd user; built
    into a .partial folder and renamed when complete, so an interrupted build is never used."""
    key = hashlib.sha256(repr((SUITE, PACKAGES, _dependencies())).encode()).hexdigest()[:12]
    root = CACHE / f"{SUITE}-{key}"
    if (root / ".complete").is_file():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(partial), MIRROR])
    useradd = (
        "useradd --system --user-group --home-dir /var/lib/soakd --no-create-home --shell /usr/sbin/nologin"
    )
    _chroot(partial, *useradd.split(), "soakd")  # README step 1
    # No terminals in a test machine: a getty on the host's tty1 would be wrong, and waits forever.
    for unit in ("console-getty.service", "getty@.service", "getty.target"):
        (partial / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (partial / "etc/systemd/system" / unit).symlink_to("/dev/null")
    _chroot(partial, "python3", "-m", "venv", VENV)
    # The wheels come through the host's pip (its index, proxy and certificates), the root installs
    # them offline: same CPython minor version (3.11), so the same wheels.
    wheelhouse = partial / "opt/soakd/wheelhouse"
    deps = _dependencies()
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheelhouse), *deps])
    offline = ["--no-index", "--find-links", "/opt/soakd/wheelhouse"]
    _chroot(partial, f"{VENV}/bin/pip", "install", "-q", *offline, *deps)
    shutil.rmtree(wheelhouse)
    (partial / ".complete").write_text(key)
    shutil.rmtree(root, ignore_errors=True)
    partial.rename(root)
    return root


def _chroot(root: Path, *argv: str) -> str:
    return _run(
        ["chroot", str(root), *argv], env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    )


def build_wheel(out: Path) -> Path:
    """soakd's wheel from this checkout, built with the dev venv's setuptools (no download)."""
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ]
    )
    (wheel,) = out.glob("soakd-*.whl")
    return wheel


# Moves itself into the machine's cgroups ($SOAKD_CGROUPS, colon-separated), then makes the namespaces.
_ENTER = 'IFS=:; for c in $SOAKD_CGROUPS; do echo $$ > "$c/cgroup.procs"; done; unset IFS; exec "$@"'
# The boot: runs as PID 1's parent in the new namespaces. $1 lower root, $2 upper, $3 work, $4 merged.
_BOOT = r"""
set -eu
unset SOAKD_CGROUPS
mount -t overlay overlay -o "lowerdir=$1,upperdir=$2,workdir=$3" "$4"
M=$4
mount -t proc proc "$M/proc"
mount --bind "$M/proc/sys" "$M/proc/sys" && mount -o remount,bind,ro "$M/proc/sys"
T=$M/proc/sysrq-trigger
if [ -e "$T" ]; then mount --bind "$T" "$T" && mount -o remount,bind,ro "$T"; fi
mount --rbind /sys "$M/sys" && mount -o remount,bind,ro "$M/sys"
mount -t tmpfs -o mode=0755,nosuid tmpfs "$M/dev"
for n in null zero full random urandom tty; do touch "$M/dev/$n"; mount --bind "/dev/$n" "$M/dev/$n"; done
touch "$M/dev/console" && mount --bind /dev/null "$M/dev/console"
mkdir -p "$M/dev/pts" "$M/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$M/dev/pts"
ln -s pts/ptmx "$M/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$M/dev/shm"
ln -s /proc/self/fd "$M/dev/fd"
# pivot_root, not chroot: a process in a chroot may not make a user namespace (the unit's
# PrivateUsers=yes would fail with 217/USER), and PID 1 must own its root.
cd "$M"
mkdir -p .host
pivot_root . .host
umount -l /.host
rmdir /.host
# Shared, as systemd-nspawn makes a container's root: systemd does not do it itself in a container, and
# without it a mount made in a service's own namespace (the credentials' ramfs) never reaches PID 1's.
mount --make-rshared /
exec env -i container=soakd-test LANG=C.UTF-8 /lib/systemd/systemd
"""


class Machine:
    """One booted systemd; commands run inside it through nsenter, files read through /proc/PID/root."""

    def __init__(self, root: Path, work: Path) -> None:
        self.work = work
        self.name = f"soakd-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        for sub in ("upper", "work", "merged"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        self.upper = work / "upper"
        self._cgroups = self._make_cgroups()
        self._log = (work / "boot.log").open("wb")
        namespaces = ["unshare", "--pid", "--mount", "--uts", "--ipc", "--fork", "--propagation", "private"]
        layers = [str(root), *(str(work / sub) for sub in ("upper", "work", "merged"))]
        self._proc = subprocess.Popen(
            ["sh", "-c", _ENTER, "enter", *namespaces, "sh", "-c", _BOOT, "boot", *layers],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "SOAKD_CGROUPS": ":".join(str(p) for p in self._cgroups)},
        )
        self.pid = self._systemd_pid()

    # --- cgroups: a subtree per hierarchy that systemd inside takes as its root ---------------------
    def _make_cgroups(self) -> list[Path]:
        made = []
        for hierarchy in sorted(p for p in CGROUP_ROOT.iterdir() if p.is_dir() and not p.is_symlink()):
            if not (hierarchy / "cgroup.procs").exists():
                continue
            path = hierarchy / self.name
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):  # cgroup v1 cpuset takes no task until these are set
                if (hierarchy / name).exists():
                    (path / name).write_text((hierarchy / name).read_text())
            made.append(path)
        if (CGROUP_ROOT / "cgroup.procs").exists():  # a pure cgroup v2 host
            path = CGROUP_ROOT / self.name
            path.mkdir(exist_ok=True)
            made.append(path)
        return made

    def _remove_cgroups(self) -> None:
        for path in self._cgroups:
            for sub in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                path.rmdir()

    def _systemd_pid(self, timeout_s: float = 30.0) -> int:
        """The host pid of the machine's PID 1 (the unshare's only child, once it has exec'd systemd)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self.shutdown()
                raise HarnessError(f"the boot exited with {self._proc.returncode}:\n{self.boot_log()}")
            children = Path(f"/proc/{self._proc.pid}/task/{self._proc.pid}/children")
            with contextlib.suppress(OSError):
                for pid in children.read_text().split():
                    if Path(f"/proc/{pid}/exe").resolve().name == "systemd":
                        return int(pid)
            time.sleep(0.05)
        self.shutdown()
        raise HarnessError(f"systemd did not start in {timeout_s:.0f} s:\n{self.boot_log()}")

    def boot_log(self) -> str:
        return (self.work / "boot.log").read_text(errors="replace")[-3000:]

    # --- inside the machine -------------------------------------------------------------------------
    def run(
        self, *argv: str, check: bool = True, timeout_s: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        """ARGV as root inside the machine (its namespaces, root and working folder)."""
        done = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "-r", "-w", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "SYSTEMD_PAGER": ""},
        )
        if check and done.returncode != 0:
            raise HarnessError(
                f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return done

    def systemctl(self, *args: str, check: bool = True, timeout_s: float = 120.0) -> str:
        return self.run("systemctl", "--no-pager", *args, check=check, timeout_s=timeout_s).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        return self.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout

    def path(self, inside: str) -> Path:
        """A path inside the machine as the host reaches it (through PID 1's root)."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")

    def wait_booted(self, timeout_s: float = 60.0) -> str:
        """`systemctl is-system-running --wait` once PID 1 listens: running, or an error naming the
        failed units."""
        deadline = time.monotonic() + timeout_s
        while not self.path("/run/systemd/private").exists():  # PID 1's socket for systemctl
            if time.monotonic() > deadline:
                raise HarnessError(f"systemd not listening after {timeout_s:.0f} s:\n{self.boot_log()}")
            time.sleep(0.05)
        left = max(1.0, deadline - time.monotonic())
        done = self.run("systemctl", "is-system-running", "--wait", check=False, timeout_s=left)
        state = done.stdout.strip()
        if state != "running":
            failed = self.systemctl("--failed", check=False)
            raise HarnessError(f"boot ended {state!r} {done.stderr.strip()}: {failed}\n{self.boot_log()}")
        return state

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Power off (SIGRTMIN+4 to PID 1, repeated: a PID 1 still booting has no handler yet and the
        kernel drops it), then SIGKILL PID 1 by its pid (that ends every process of the namespace; PID 1
        has its own session, so the boot's process group does not hold it), and remove the cgroups."""
        pid = getattr(self, "pid", None)
        deadline = time.monotonic() + timeout_s
        if pid is not None:
            while _alive(pid) and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGRTMIN + 4)
                for _ in range(20):
                    if not _alive(pid):
                        break
                    time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)
        self._log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the last processes leave their cgroups as they are reaped
            self._remove_cgroups()
            if not any(p.exists() for p in self._cgroups):
                break
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Whether PID exists and is not a zombie (a PID 1 that exited waits for the namespace's parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def prepare(root: Path, work: Path, files: dict[str, tuple[bytes, int]], wheel: Path) -> None:
    """Write FILES (path inside: (content, mode)) and install WHEEL into the venv, in the machine's upper
    layer before it boots, as an administrator following systemd/README.md would."""
    merged = work / "merged"
    for sub in ("upper", "work", "merged"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    wheel_dir = work / "upper" / "opt/soakd/wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, wheel_dir / wheel.name)
    for inside, (content, mode) in files.items():
        target = work / "upper" / inside.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    layers = f"lowerdir={root},upperdir={work}/upper,workdir={work}/work"
    script = (
        f'mount -t overlay overlay -o "{layers}" {merged} && '
        f"chroot {merged} {VENV}/bin/pip install -q --no-deps --no-index /opt/soakd/wheels/{wheel.name}"
    )
    _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], timeout_s=300)


@contextlib.contextmanager
def booted(root: Path, work: Path) -> Iterator[Machine]:
    machine = Machine(root, work)
    try:
        machine.wait_booted()
        yield machine
    finally:
        machine.shutdown()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] != "build":
        sys.exit("usage: systemd_root.py build")
    reason = unavailable()
    if reason:
        sys.exit(f"cannot boot a test machine here: {reason}")
    start = time.monotonic()
    print(build_root(), f"({time.monotonic() - start:.0f} s)")
