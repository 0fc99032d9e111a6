"""A Ray head node on 127.0.0.1 that this process owns (tests, benchmarks, demos).

`ray start --head --block` in its own session with free ports and a private temp
dir, so that it never collides with another Ray on the machine; `stop()` ends
exactly the processes it started (its process group), never `ray stop`, which
would kill every Ray on the host.

`LocalWorkerNode` adds a second Ray node on the same machine and loopback
(`ray start --address=HEAD --block` in its own session); `kill()` SIGKILLs every
process of that session at once (raylet, agents, worker processes), which is what
the rest of the cluster sees when a worker machine dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid


# Ray turns --node-ip-address=127.0.0.1 into the host's routable address unless
# "cluster mode" is off (the single-machine mode Ray uses on macOS/Windows): then
# every component binds and talks on 127.0.0.1 only. Set it in the driver too,
# before `import ray`.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


# Ray's client loads the auth token once per process and keeps it, so every head this process
# starts gets the same private token: a later head with a token of its own would refuse it.
_PROCESS_TOKEN = uuid.uuid4().hex + uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, worker_range: int, taken: list[int] = ()) -> tuple[list[int], int]:
    """`n` distinct free ports besides `taken`, and the first port of a worker range
    [w, w + worker_range] that holds none of them (Ray refuses to start on an overlap)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports and p not in taken:
            ports.append(p)
    fixed = [*taken, *ports]
    while True:
        w = free_port()
        if w + worker_range < 65536 and not any(w <= p <= w + worker_range for p in fixed):
            return ports, w


class LocalHead:
    def __init__(self, num_cpus: int = 8, object_store_mb: int = 512, temp_dir: str | None = None,
                 resources: dict[str, float] | None = None, system_env: dict[str, str] | None = None):
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.resources = resources or {}           # custom Ray resources of the head node
        self.system_env = system_env or {}         # RAY_<system config> for the head's processes only
        self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="oscar-ray-", dir="/tmp")
        self._own_temp = temp_dir is None  # ours to remove once the head has run and stopped
        self._ran = False
        self.port = free_port()
        self.dashboard_port = free_port()
        self.proc: subprocess.Popen | None = None
        # Token auth with a private token: the Jobs API and the GCS refuse anyone without it.
        self.token_path = os.path.join(self.temp_dir, "auth_token")
        with open(os.open(self.token_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600), "w") as f:
            f.write(_PROCESS_TOKEN)

    @property
    def env(self) -> dict[str, str]:
        """Environment a client of this head needs (set it before `import ray`; subprocesses inherit it)."""
        return {**LOOPBACK_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}

    def use(self) -> None:
        """Point this process's Ray client at this head (before `import ray`)."""
        os.environ.update(self.env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @contextlib.contextmanager
    def session(self):
        """This process pointed at this head (before `import ray`), the head started, and on exit stopped and
        the environment restored: how a test or a one-off driver holds a private local cluster."""
        saved = dict(os.environ)
        self.use()
        try:
            self.start()
            yield self
        finally:
            self.stop()
            os.environ.clear()
            os.environ.update(saved)

    def start(self, timeout: float = 180.0) -> "LocalHead":
        p, wmin = free_ports(7, 200, taken=[self.port, self.dashboard_port])
        ports = {
            "--port": self.port, "--dashboard-port": self.dashboard_port,
            "--node-manager-port": p[0], "--object-manager-port": p[1],
            "--dashboard-agent-listen-port": p[2], "--dashboard-agent-grpc-port": p[3],
            "--runtime-env-agent-port": p[4], "--metrics-export-port": p[5],
            "--ray-client-server-port": p[6],
        }
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
               f"--num-cpus={self.num_cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
               f"--object-store-memory={self.object_store_mb << 20}", "--disable-usage-stats",
               f"--min-worker-port={wmin}", f"--max-worker-port={wmin + 200}"]
        cmd += [f"{k}={v}" for k, v in ports.items()]
        if self.resources:
            cmd.append(f"--resources={json.dumps(self.resources)}")
        self.log = open(os.path.join(self.temp_dir, "ray-start.log"), "w")
        env = {**os.environ, **self.env, **self.system_env}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited ({self.proc.returncode}); see {self.log.name}")
            if self._jobs_ready():
                self._ran = True
                return self
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"Ray head did not come up in {timeout:.0f}s; see {self.log.name}")

    def _jobs_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2):
                pass
        except urllib.error.HTTPError:
            pass  # up, but wants the auth token: the Jobs client below sends it
        except OSError:
            return False
        try:
            # late: ray reads its cluster mode when imported; connect() sets LOOPBACK_ENV first (cluster/localray.py)
            from ray.job_submission import JobSubmissionClient

            JobSubmissionClient(self.dashboard).list_jobs()
            return True
        except Exception:  # noqa: BLE001 - not ready yet
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM `ray start --block` (it stops what it started), then SIGKILL its process group."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # session leader: its pid is the group id
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.time() + 15
        while time.time() < deadline:  # until the group is gone (children are reaped by init)
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
        for pid in session_pids(pgid):  # Ray workers have their own process group, same session
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc = None
        self.log.close()
        if self._own_temp and self._ran:  # a head that never came up keeps its ray-start.log for the error to name
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "LocalHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# `ray start` refuses to join a second node in single-node mode, and in cluster mode it
# rewrites 127.0.0.1 into the host's routable address. This launcher keeps single-node
# address resolution (everything on 127.0.0.1) and lifts only the join guard.
_JOIN_ON_LOOPBACK = (
    "import sys, types\n"
    "import ray._private.ray_constants as rc\n"
    "import ray.scripts.scripts as sc\n"
    "sc.ray_constants = types.SimpleNamespace(**{**vars(rc), 'ENABLE_RAY_CLUSTER': True})\n"
    "sys.argv[0] = 'ray'\n"
    "sc.main()\n")


def session_pids(sid: int) -> list[int]:
    """Processes whose session id is `sid` (everything a `start_new_session` child started,
    including Ray worker processes, which get their own process group but keep the session)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
            out.append(int(d))
    return out


class LocalWorkerNode:
    """A second Ray node joined to a `LocalHead` on this machine, on 127.0.0.1, with its own temp
    dir, ports and (typically) a custom resource so that work can be steered onto it."""

    def __init__(self, head: LocalHead, num_cpus: int = 1, resources: dict[str, float] | None = None,
                 object_store_mb: int = 128):
        self.head = head
        self.num_cpus = num_cpus
        self.resources = resources or {}
        self.object_store_mb = object_store_mb
        self.temp_dir = tempfile.mkdtemp(prefix="oscar-ray-node-", dir="/tmp")
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self, timeout: float = 120.0) -> "LocalWorkerNode":
        p, wmin = free_ports(6, 100)
        cmd = [sys.executable, "-c", _JOIN_ON_LOOPBACK, "start", "--block", f"--address={self.head.address}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               f"--resources={json.dumps(self.resources)}", f"--temp-dir={self.temp_dir}",
               f"--object-store-memory={self.object_store_mb << 20}", "--disable-usage-stats",
               f"--min-worker-port={wmin}", f"--max-worker-port={wmin + 100}",
               f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
               f"--dashboard-agent-listen-port={p[2]}", f"--dashboard-agent-grpc-port={p[3]}",
               f"--runtime-env-agent-port={p[4]}", f"--metrics-export-port={p[5]}"]
        self.log = open(os.path.join(self.temp_dir, "ray-start.log"), "w")
        env = {**os.environ, **self.head.env}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start (worker node) exited ({self.proc.returncode}); see {self.log.name}")
            with open(self.log.name) as f:
                if "Ray runtime started" in f.read():
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Ray worker node did not come up in {timeout:.0f}s; see {self.log.name}")

    def kill(self, timeout: float = 30.0) -> list[int]:
        """SIGKILL every process of this node at once (no graceful shutdown): a lost machine.
        Returns the pids killed."""
        if self.proc is None:
            return []
        sid, killed = self.proc.pid, []
        deadline = time.time() + timeout
        while (pids := session_pids(sid)) and time.time() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                self.proc.wait(timeout=0.2)  # reap `ray start`; the rest are reaped by init
            except subprocess.TimeoutExpired:
                pass
        self.proc = None
        if self.log:
            self.log.close()
        return sorted(set(killed))

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM `ray start --block` (it stops what it started), SIGKILL what is left, remove the temp dir."""
        if self.proc is not None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
            self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
