"""Run a function in N real ``torch.distributed`` processes (gloo, CPU) for tests.

API
---
``run_distributed(fn, world_size, *, args=(), kwargs=None, timeout=120.0,
backend="gloo", env=None) -> list``

- ``fn`` must be picklable by reference: a module-level function of an
  importable module (a test module is fine; the child imports it by name with
  the parent's ``sys.path``). It is called as ``fn(*args, **kwargs)`` in every
  rank after ``dist.init_process_group`` has run, so it reads its rank with
  ``dist.get_rank()`` / ``dist.get_world_size()`` and may build device meshes
  with ``init_device_mesh("cpu", ...)``.
- Returns the per-rank return values, ordered by rank. Return values travel
  through a multiprocessing queue: keep them small and picklable (CPU
  tensors, numbers, strings).
- If any rank raises, :class:`DistributedFailure` (an ``AssertionError``) is
  raised in the caller, with every failing rank's full child traceback in its
  message; the other ranks get ``grace`` seconds to finish and are then
  killed. A rank that dies without reporting (segfault, ``os._exit``) is
  reported with its exit code.
- ``timeout`` bounds the whole run (spawn, init, ``fn``, teardown): past it
  every child still alive is killed and :class:`DistributedFailure` names the
  ranks that had not finished, so a hang fails the test instead of hanging
  it. The same timeout is given to ``init_process_group``, so a collective
  that can never complete raises inside the child too.

Rendezvous uses a ``file://`` store in a fresh temporary directory (no TCP
port to pick, so concurrent test runs cannot collide). Children run with
``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` so that N ranks do not
oversubscribe a small machine; ``env`` adds environment variables to them.

``start_method`` (default :data:`START_METHOD`): ``"forkserver"`` where the
platform has it, else ``"spawn"``. The fork server is started once per parent
process with torch, torch.distributed and keyinit preloaded, so each later run
starts its ranks in a fraction of a second instead of re-importing torch in
every rank (``spawn``: seconds per rank). ``"spawn"`` gives the most
isolation; ``"fork"`` is fastest but forks the (possibly multithreaded) test
process, use it only if you know the parent is fork-safe. Results are
pickled by value (tensors included), never through shared memory, so they
stay valid after the rank exits.

``requires_gloo`` is a pytest mark that skips when gloo is unavailable.

Example::

    def _check_sum():                      # module level: picklable
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        return float(t)

    def test_sum():
        assert run_distributed(_check_sum, 2) == [1.0, 1.0]
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist

__all__ = ["run_distributed", "DistributedFailure", "requires_gloo", "START_METHOD"]

#: The default start method: a fork server (preloaded with torch) where available, else spawn.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp", "keyinit"]

requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed gloo backend unavailable"
)


class DistributedFailure(AssertionError):
    """One or more ranks failed, died or timed out; the message holds their tracebacks."""


def _child(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    timeout: float,
    env: Mapping[str, str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        try:
            value = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, False, traceback.format_exc()))
        return
    try:
        payload = pickle.dumps(value)  # by value: no shared memory that dies with this process
    except Exception:  # noqa: BLE001 - an unpicklable result
        results.put((rank, False, "rank returned an unpicklable value:\n" + traceback.format_exc()))
        return
    results.put((rank, True, payload))


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Optional[Mapping[str, str]] = None,
    grace: float = 5.0,
    start_method: Optional[str] = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` processes; return the per-rank results.

    ``grace``: seconds the other ranks get to finish once one rank has failed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    tmpdir = tempfile.mkdtemp(prefix="keyinit-dist-")
    init_method = "file://" + os.path.join(tmpdir, "store")
    ctx = multiprocessing.get_context(start_method or START_METHOD)
    if ctx.get_start_method() == "forkserver":
        # Only takes effect when the server starts (the first run in this process).
        ctx.set_forkserver_preload([*_PRELOAD, getattr(fn, "__module__", None) or "torch"])
    results = ctx.Queue()
    procs = []
    deadline = time.monotonic() + timeout
    received: dict[int, tuple[bool, Any]] = {}
    failure_deadline: Optional[float] = None
    timed_out = False
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, init_method, backend, timeout, child_env, fn, tuple(args), dict(kwargs or {}),
                      results),
                name=f"keyinit-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        while len(received) < world_size:
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if failure_deadline is not None and now >= failure_deadline:
                break
            try:
                rank, ok, value = results.get(timeout=0.1)
            except queue_module.Empty:
                # A rank that exited without reporting (crash): stop waiting for it.
                dead = [r for r, p in enumerate(procs) if r not in received and p.exitcode is not None]
                if dead:
                    # Its report may still be in flight: drain once more before declaring it dead.
                    try:
                        rank, ok, value = results.get(timeout=0.5)
                    except queue_module.Empty:
                        for r in dead:
                            received[r] = (False, f"rank {r} exited with code {procs[r].exitcode} without reporting")
                        if failure_deadline is None:
                            failure_deadline = time.monotonic() + grace
                        continue
                else:
                    continue
            received[rank] = (ok, value)
            if not ok and failure_deadline is None:
                failure_deadline = time.monotonic() + grace
    finally:
        # Ranks that reported exit on their own; ranks still running after a failure or the
        # timeout have had their time and are killed (only the processes started here).
        everyone_reported = len(received) == world_size and not timed_out
        for proc in procs:
            if everyone_reported:
                proc.join(timeout=max(0.1, min(grace, deadline - time.monotonic())))
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)

    failures = [(r, v) for r, (ok, v) in sorted(received.items()) if not ok]
    missing = [r for r in range(world_size) if r not in received]
    if failures or missing or timed_out:
        parts = []
        if timed_out:
            parts.append(f"timed out after {timeout:.0f} s")
        for rank, message in failures:
            parts.append(f"--- rank {rank} failed ---\n{message}")
        if missing:
            parts.append(f"ranks {missing} did not finish (killed)")
        raise DistributedFailure(f"{getattr(fn, '__qualname__', fn)} on {world_size} ranks: " + "\n".join(parts))
    return [pickle.loads(received[r][1]) for r in range(world_size)]
