"""Independent units of validation work (NIAH batches, perplexity windows) spread over worker processes.

Why processes: a needle batch's decode is thousands of small, memory-bound ops (one-token attention
over the float32 row cache, right-sized matmuls); torch's intra-op threads barely speed those up on
this 2-core host (`oscar run`'s needle stage gained 1.35x from batching where the one-thread CPU
ratio promised 1.9x: the old loop's bf16 SDPA kernel was compute-bound and used both threads, the
new loop's ops do not), and with another job on the cores OpenMP barriers stall. Two processes of
one intra-op thread each keep both cores busy on every op. Measured on the quiet host, that bought
little (needles 579 s vs 613 s in one process, perplexity 277 s vs 255 s: docs/decisions/0056-needle-and-perplexity-units-on-worker-processes.md, "Needle
and perplexity units on worker processes"); results are unchanged either way.

Each worker is a spawned process (no fork of a process that ran OpenMP threads or Ray) holding a
copy of the parent's model (saved once to a temporary file: the same weights bit for bit, whatever
loaded them), runs one intra-op thread, and computes exactly what the in-process path computes with
one thread. Units go round-robin (`static`: unit i to worker i % n, so a worker's own state, e.g.
its prefill pool, sees the same units in every run) or to whichever worker is free.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
import traceback
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as tmp

from oscar.common import OscarError, usable_cpus

MAX_WORKERS = 4  # each holds a model copy and its batch's cache (~1.5 GB for SmolLM2 at the NIAH defaults)


def default_workers(units: int) -> int:
    """Worker processes worth starting: the CPUs this process may use (affinity, cgroup quota), at most
    MAX_WORKERS and `units`; 1 means run in this process."""
    n = int(usable_cpus()[2])
    env = os.environ.get("OSCAR_WORKERS")
    if env:
        n = int(env)
    return max(1, min(n, MAX_WORKERS, units))


_STATE: dict = {}  # inside a worker: what its init function returned


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when its parent dies. A parent killed by a signal never closes the pipe
    politely, and a worker inside a long unit (a 32k prefill) would run on for minutes as an orphan."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def _main(conn, model_path: str, threads: int, init, init_arg) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops feeding units and closes us
    _die_with_parent()

    torch.set_num_threads(threads)
    try:
        model = torch.load(model_path, weights_only=False)
        _STATE.clear()
        _STATE.update(init(model, init_arg) if init else {"model": model})
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            return
        i, fn, arg = msg
        try:
            conn.send(("ok", (i, fn(_STATE, arg))))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Workers:
    """`n` worker processes holding `model`; `init(model, init_arg)` (a module-level function) builds
    each worker's state dict, passed to every unit function. Use as a context manager."""

    def __init__(self, n: int, model, init=None, init_arg=None, threads: int = 1):
        if n < 1:
            raise OscarError(f"workers must be >= 1, got {n}")
        ctx = tmp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="oscar-workers-")
        path = os.path.join(self._dir.name, "model.pt")
        torch.save(model, path)
        self.conns, self.procs, self.ready = [], [], False
        try:
            for _ in range(n):
                a, b = ctx.Pipe()
                p = ctx.Process(target=_main, args=(b, path, threads, init, init_arg), daemon=True)
                p.start()
                b.close()
                self.conns.append(a)
                self.procs.append(p)
        except BaseException:
            self.close()
            raise

    def _recv(self, conn):
        try:
            kind, val = conn.recv()
        except EOFError:
            raise OscarError("a validation worker process died (killed, or out of memory)") from None
        if kind == "error":
            raise OscarError(f"validation worker failed:\n{val}")
        return val

    def map(self, fn, args: list, static: bool = False):
        """Yield (i, fn(state, args[i])) as units finish; unit i goes to worker i % n when `static`."""
        if not self.ready:  # workers load while the caller prepares the units
            for c in self.conns:
                self._recv(c)  # "ready", or the worker's error
            self.ready = True
            self._dir.cleanup()  # every worker holds its copy: the file (the model's size) goes now, not at close
        n = len(self.conns)
        queues = [list(range(w, len(args), n)) for w in range(n)] if static else None
        shared = list(range(len(args)))[::-1]
        busy: dict = {}

        def feed(w: int) -> None:
            q = queues[w] if static else shared
            if q:
                i = q.pop(0) if static else q.pop()
                self.conns[w].send((i, fn, args[i]))
                busy[self.conns[w]] = w

        for w in range(n):
            feed(w)
        while busy:
            for c in wait(list(busy)):
                w = busy.pop(c)
                i, res = self._recv(c)
                feed(w)
                yield i, res

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
        self.conns, self.procs = [], []
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
