"""Run a function in N local CPU processes with a gloo process group (no torchrun needed).

Rendezvous goes through a ``file://`` store in a fresh temporary directory, so
there is no TCP port to pick and concurrent runs cannot collide. Children are
started with the ``spawn`` method and one torch thread each. A rank that
raises, dies or outlives ``timeout`` fails the whole run with its traceback.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

__all__ = ["spawn", "SpawnError"]


class SpawnError(RuntimeError):
    """A rank failed, died or timed out. ``summary`` is one line; ``str()`` has the rank's traceback."""

    def __init__(self, message: str, summary: str = "") -> None:
        super().__init__(message)
        self.summary = summary or message


def _child(rank: int, world_size: int, init_method: str, timeout: float, fn: Callable[..., Any],
           args: Sequence[Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        # pickled by value: torch's multiprocessing reductions would share tensors through
        # file descriptors that die with this process
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout: float = 300.0,
          preload: Sequence[str] = ()) -> list[Any]:
    """``fn(*args)`` in ``world_size`` gloo ranks; returns the per-rank results in rank order.

    ``fn`` must be a module-level function of an importable module. On POSIX the
    ranks are forked from a fresh ``forkserver`` that has imported ``preload``
    (and ``fn``'s module) once, so N ranks do not import torch N times; elsewhere
    they are spawned.
    """
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "keyinit", "keyinit.cli._spawn", fn.__module__, *preload])
    else:  # pragma: no cover - Windows
        ctx = multiprocessing.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="keyinit-spawn-")
    init_method = "file://" + os.path.join(tmp, "store")
    results = ctx.Queue()
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(target=_child, args=(rank, world_size, init_method, timeout, fn, tuple(args), results),
                               daemon=True)
            proc.start()
            procs.append(proc)
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
                if not ok:
                    break
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    # give a just-exited rank's message a moment to arrive
                    try:
                        rank, ok, value = results.get(timeout=1.0)
                        got[rank] = (ok, value)
                        continue
                    except queue_module.Empty:
                        raise SpawnError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in got]
                    raise SpawnError(f"ranks {missing} did not finish within {timeout:.0f}s")
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            rank = min(failed)
            lines = [line for line in str(failed[rank]).strip().splitlines() if line.strip()]
            last = lines[-1].strip() if lines else "unknown error"
            raise SpawnError(f"rank {rank} failed:\n{failed[rank]}",
                             f"rank {rank} failed: {last} (rerun with --debug for its traceback)")
        return [pickle.loads(got[r][1]) for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
        shutil.rmtree(tmp, ignore_errors=True)
