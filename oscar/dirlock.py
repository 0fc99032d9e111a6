"""One writer per output directory: the run directory of `oscar run` / `oscar validate niah|ppl --out`, and a
calibration store (`oscar calibrate --store`, the Ray driver's too).

A writer holds `DirLock` for its whole lifetime. Two mechanisms share one lock file:

- `fcntl.flock` on it: on one host the kernel holds the lock for the process and drops it the moment the process
  dies (kill -9 included), so a second writer's non-blocking attempt fails at once and a dead one's never blocks.
- a JSON holder record in the same file (host, pid, the process's start tick, start time, command, lease expiry):
  what the refusal names, and the rule across hosts, where a shared filesystem may not carry flock between nodes:
  a heartbeat thread renews the lease every LEASE_S / 4 seconds; a holder on another host whose lease has run out
  (its node was lost) is stale. On this host a holder is stale when its pid is gone or belongs to a newer process.

A stale lock is taken over with a line on stderr, so a re-run resumes after kill -9 or a node loss. The lock file
is removed on release: a finished directory holds exactly what the command wrote. Readers never take the lock.
The calibration store's per-layer `WriterLock` (pipeline/store.py) judges its holders with the same rules
(`holder_alive`) and renews its records with the same heartbeat.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from oscar.common import OscarError

LOCK_NAME = ".oscar-writer.lock"  # inside a run directory
STORE_LOCK_NAME = "writer.lock"  # in a store's `<store>.lock/` folder, beside the zarr group (not inside its format)
LEASE_S = 60.0  # a holder on another host is stale this long after its last heartbeat


def proc_start(pid: int) -> str | None:
    """The process's start tick (/proc/PID/stat field 22): tells a live holder from a reused pid; None: gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return None if parts[0] == "Z" else parts[19]  # state, starttime
    except (OSError, IndexError):
        return None


def holder_alive(rec: dict, host: str | None = None) -> bool:
    """Whether the holder a lock record names still runs: on this host by its pid (and start tick, against pid
    reuse); on another host by its lease (a record without one: assumed alive)."""
    if rec.get("host") != (host or socket.gethostname()):
        until = rec.get("lease_until")
        return until is None or time.time() < float(until)
    pid = int(rec.get("pid", -1))
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        start = proc_start(pid)
        return start is not None and rec.get("start") in (None, start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def this_command() -> str:
    """The command line of this process as a user typed it (`oscar run --out D ...`), cut to 300 characters."""
    argv = list(sys.argv) or ["?"]
    head = os.path.basename(argv[0])
    if head in ("__main__.py", "-m", "-c"):
        head = "python " + head
    return " ".join([head, *argv[1:]]).replace("\n", " ")[:300]  # one line: the refusal is one line


def holder_record(command: str | None = None) -> dict:
    """This process as a lock record names it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": proc_start(os.getpid()),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": command or this_command(),
            "lease_until": time.time() + LEASE_S}


def describe_holder(rec: dict) -> str:
    """"pid 123 on host h since 2026-...Z (oscar run --out D)": who holds a lock."""
    cmd = rec.get("command") or rec.get("argv")
    return (f"pid {rec.get('pid')} on {rec.get('host')} since {rec.get('since')}" + (f" ({cmd})" if cmd else ""))


def _decode(text: str) -> dict:
    """A record as written, trailing bytes of a longer previous record ignored (a heartbeat rewrites in place)."""
    try:
        rec, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return {}
    return rec if isinstance(rec, dict) else {}


def read_record(path: str | os.PathLike) -> dict:
    try:
        return _decode(Path(path).read_text())
    except OSError:
        return {}


# --------------------------------------------------------------------------- the heartbeat

class _Heartbeat:
    """One daemon thread per process renewing the lease of every record this process holds."""

    def __init__(self):
        self.renewers: dict[object, object] = {}
        self.mu = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, key: object, renew) -> None:
        with self.mu:
            self.renewers[key] = renew
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="oscar-lock-lease", daemon=True)
                self.thread.start()

    def remove(self, key: object) -> None:
        with self.mu:
            self.renewers.pop(key, None)

    def _loop(self) -> None:
        while True:
            time.sleep(LEASE_S / 4)
            with self.mu:
                renewers = list(self.renewers.values())
            for renew in renewers:
                try:
                    renew(time.time() + LEASE_S)
                except OSError:
                    pass  # a lock file gone (released under us): nothing to renew


HEARTBEAT = _Heartbeat()


def renew_file(path: Path, job_key: str, job: str):
    """A renewer for a record file owned by `job` (its `job_key` field): rewritten atomically with a new lease,
    only while it still names `job` (a takeover after a paused process is not undone)."""
    def renew(until: float) -> None:
        rec = read_record(path)
        if rec.get(job_key) != job:
            return
        tmp = path.with_suffix(f".{os.getpid()}.lease")
        tmp.write_text(json.dumps({**rec, "lease_until": until}))
        os.replace(tmp, path)
    return renew


# --------------------------------------------------------------------------- the lock

_HELD: dict[str, "DirLock"] = {}  # lock file (real path) -> the DirLock this process holds on it
_HELD_MU = threading.Lock()


def lock_file(directory: str | os.PathLike, *, store: bool = False) -> str:
    """The lock file of a run directory (inside it) or of a calibration store (`<store>.lock/`, beside it)."""
    d = str(directory).rstrip("/") or "/"
    return os.path.join(d + ".lock", STORE_LOCK_NAME) if store else os.path.join(d, LOCK_NAME)


def _missing_dirs(d: str) -> list[str]:
    """The folders of `d` that do not exist yet, innermost first (what makedirs would create)."""
    out = []
    d = os.path.abspath(d)
    while not os.path.exists(d):
        out.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    return out


class DirLock:
    """The exclusive write lock of `directory` for a command's lifetime (`with DirLock(d): ...`).

    Taken again by the same process (the main job's stages each lock the run directory), it is shared: released
    when the outermost holder lets go. Another process, on this host or another, is refused in one line naming
    the holder; a stale holder is taken over, said on stderr.
    """

    def __init__(self, directory: str | os.PathLike, *, store: bool = False, what: str | None = None,
                 command: str | None = None):
        self.directory = str(directory)
        self.path = lock_file(directory, store=store)
        self.store = store
        self.what = what or ("calibration store" if store else "directory")
        self.command = command
        self.fd: int | None = None
        self.depth = 0
        self.rec: dict = {}
        self.made: list[str] = []  # folders the lock itself created, innermost first
        self.mu = threading.Lock()  # the heartbeat's renewal and the release never interleave

    # ------------------------------------------------------------ checks without taking it
    def refusal(self, rec: dict) -> OscarError:
        return OscarError(f"{self.what} {self.directory} is being written by {describe_holder(rec)}; wait for it to "
                          "finish (a re-run then resumes), or write to another directory")

    def check_free(self) -> None:
        """Refuse now, writing nothing, when another live process holds the lock (a second writer is told before
        any work; acquiring later still decides a race)."""
        if os.path.realpath(self.path) in _HELD or not os.path.exists(self.path):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
            except BlockingIOError:
                raise self.refusal(read_record(self.path)) from None
            except OSError:
                pass  # a filesystem without flock: the record decides
        finally:
            os.close(fd)
        rec = read_record(self.path)
        if rec and rec.get("host") != socket.gethostname() and holder_alive(rec):
            raise self.refusal(rec)

    # ------------------------------------------------------------ taking it
    def _open_locked(self) -> int:
        """The lock file opened and flock-ed by this process (the file a releasing holder unlinks before closing is
        detected by its inode and opened anew)."""
        for _ in range(100):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # the folder removed by a releasing holder in between
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = _decode(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
                os.close(fd)
                raise self.refusal(rec) from None
            except OSError:
                return fd  # a filesystem without flock: the holder record and its lease decide alone
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
        raise OscarError(f"cannot lock {self.path}: it keeps being replaced")

    def _write(self, rec: dict) -> None:
        data = json.dumps(rec).encode()
        os.pwrite(self.fd, data, 0)
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)

    def acquire(self) -> "DirLock":
        key = os.path.realpath(self.path)
        with _HELD_MU:
            held = _HELD.get(key)
            if held is not None:
                held.depth += 1
                self._shared = held
                return self
        self.made = _missing_dirs(os.path.dirname(self.path))
        try:
            fd = self._open_locked()
        except BaseException:
            self._remove_made()
            raise
        old = _decode(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
        mine = old.get("host") == socket.gethostname() and old.get("pid") == os.getpid()
        if old and not mine and holder_alive(old):
            # flock was free, yet the record names a live holder: one on another node of a shared filesystem
            # (flock may not reach across), or a filesystem without flock
            os.close(fd)
            raise self.refusal(old)  # the file is the holder's: left as it is
        self.fd, self.rec, self.depth = fd, holder_record(self.command), 1
        if old and not mine:
            why = "its process is gone" if old.get("host") == socket.gethostname() else "its lease expired"
            print(f"oscar: taking over the stale lock of {self.what} {self.directory} ({why}): "
                  f"{describe_holder(old)}", file=sys.stderr, flush=True)
        self._write(self.rec)
        with _HELD_MU:
            _HELD[key] = self
        HEARTBEAT.add(id(self), self._renew)
        return self

    def _renew(self, until: float) -> None:
        with self.mu:
            if self.fd is not None:
                self.rec = {**self.rec, "lease_until": until}
                self._write(self.rec)

    def release(self) -> None:
        shared = getattr(self, "_shared", None)
        if shared is not None:
            self._shared = None
            shared.release()
            return
        if self.fd is None:
            return
        self.depth -= 1
        if self.depth > 0:
            return
        HEARTBEAT.remove(id(self))
        with _HELD_MU:
            _HELD.pop(os.path.realpath(self.path), None)
        with self.mu:
            try:
                os.unlink(self.path)  # before unlocking: a waiter that opened this inode sees it replaced
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        self._remove_made()
        if self.store:
            try:
                os.rmdir(os.path.dirname(self.path))  # `<store>.lock/`, when no layer lock is left in it
            except OSError:
                pass

    def _remove_made(self) -> None:
        """A command refused after taking the lock, having written nothing, leaves no directory behind."""
        for d in self.made:
            try:
                os.rmdir(d)  # only when empty
            except OSError:
                break
        self.made = []

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
