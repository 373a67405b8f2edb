"""A ``torch.distributed.pipelining`` schedule that drives a keyed stage without ``keyinit.nn.micro_batches``.

A schedule calls its stage's ``forward_one_chunk`` once per micro-batch, on rows ``0 .. m-1`` of each chunk: under
``keyed`` alone every chunk after the first holds rows that the first one drew for, so it would be keyed as a
repeat (spec 14.6) and draw other masks than the unpipelined forward, silently. :func:`refuse_unwrapped_chunk`,
called for a root forward that would be such a repeat, refuses it when a schedule's ``forward_one_chunk`` runs
it and no :class:`keyinit.nn.micro_batches` wrapper gives the chunk its rows; the stage's own error wraps
it, and :func:`surface_chunk_error` raises it again as the keyed block is left.

Both are told explicitly, per thread, by the code that runs the chunk: ``micro_batches``' wrapper runs its
chunk inside :func:`wrapped_chunk`, and while any keyed context has hooks on a model (:func:`hold_chunk_marks`,
counted as keyinit's guards on checkpoints are), the ``forward_one_chunk`` of torch's pipelining stages (each
class of ``torch.distributed.pipelining.stage`` that defines it, when that module is imported) runs inside
:func:`running_chunk`; torch's method is its own again when the last such context is left. A stage class of
one's own that overrides ``forward_one_chunk`` without calling torch's is not seen.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["UnwrappedChunkError", "refuse_unwrapped_chunk", "surface_chunk_error", "hold_chunk_marks",
           "running_chunk", "wrapped_chunk"]

_STAGES = "torch.distributed.pipelining.stage"
_marks = threading.local()  # .chunks: ids of the stages' chunks running in this thread, innermost last; .wrapped
_lock = threading.Lock()
_holders = [0]
_marked: list[tuple[Any, str, Any]] = []  # (class, attribute, what it held before): what hold_chunk_marks replaced


class _Mark:
    """Context manager: one more (``chunk`` not None: a stage's chunk ``chunk``; else a ``micro_batches`` chunk)
    running in this thread."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: Any) -> None:
        self.chunk = chunk

    def __enter__(self) -> None:
        marks = _marks.__dict__
        if self.chunk is None:
            marks["wrapped"] = marks.get("wrapped", 0) + 1
        else:
            marks.setdefault("chunks", []).append(self.chunk)

    def __exit__(self, *exc_info: Any) -> None:
        marks = _marks.__dict__
        if self.chunk is None:
            marks["wrapped"] -= 1
        else:
            marks["chunks"].pop()


def running_chunk(chunk: Any) -> _Mark:
    """Context manager: a pipelining stage's ``forward_one_chunk(chunk, ...)`` runs in this thread."""
    return _Mark(chunk)


def wrapped_chunk() -> _Mark:
    """Context manager: a chunk that :class:`keyinit.nn.micro_batches` gives its rows runs in this thread."""
    return _Mark(None)


def _marking(original: Any) -> Any:
    def forward_one_chunk(self: Any, fwd_chunk_id: Any, *args: Any, **kwargs: Any) -> Any:
        with _Mark(fwd_chunk_id):
            return original(self, fwd_chunk_id, *args, **kwargs)

    forward_one_chunk.__wrapped__ = original  # type: ignore[attr-defined]
    return forward_one_chunk


_found: list[tuple[Any, list[tuple[type, Any, Any]]]] = []  # (the stage module, its (class, method, marking))


def _markings(stages: Any) -> list[tuple[type, Any, Any]]:
    """Each class of the stage module that defines ``forward_one_chunk``, its method and the marking wrapper
    of it (found again when the module or a method changed since)."""
    if not _found or _found[0][0] is not stages or any(owner.__dict__.get("forward_one_chunk") is not method
                                                         for owner, method, _ in _found[0][1]):
        found = [(owner, owner.__dict__["forward_one_chunk"]) for owner in list(vars(stages).values())
                 if isinstance(owner, type) and "forward_one_chunk" in owner.__dict__]
        _found[:] = [(stages, [(owner, method, _marking(method)) for owner, method in found])]
    return _found[0][1]


def hold_chunk_marks(n: int) -> None:
    """``n`` (1 or -1) more contexts with hooks on a model: torch's pipelining stages mark their chunks while
    any (see the module docstring), and are torch's own again after."""
    with _lock:
        before = _holders[0]
        _holders[0] = before + n
        if n > 0:
            stages = sys.modules.get(_STAGES)
            if stages is not None and not _marked:  # (imported after an earlier hold: marked now)
                for owner, original, marking in _markings(stages):
                    _marked.append((owner, "forward_one_chunk", original))
                    setattr(owner, "forward_one_chunk", marking)
        elif before + n == 0:
            while _marked:
                owner, name, held = _marked.pop()
                setattr(owner, name, held)


class UnwrappedChunkError(RuntimeError):
    """A pipelining schedule's micro-batch run under ``keyed`` without ``keyinit.nn.micro_batches``."""


def surface_chunk_error(exc: BaseException) -> None:
    """Raise the :class:`UnwrappedChunkError` that the stage's own error (``[Stage 0] failed to run forward``)
    wraps, as the keyed block is left, so that the message naming ``micro_batches`` is the one seen."""
    seen, cause = 0, exc
    while cause is not None and seen < 8:
        if isinstance(cause, UnwrappedChunkError):
            if cause is not exc:
                raise cause.with_traceback(cause.__traceback__) from exc
            return
        cause, seen = cause.__cause__, seen + 1


def refuse_unwrapped_chunk(module: Any, fqn: str, count: int) -> None:
    """Raise when this root forward runs inside a pipelining stage's ``forward_one_chunk`` that
    :class:`keyinit.nn.micro_batches` does not wrap (its repeat count is > 0: see the module docstring)."""
    marks = _marks.__dict__
    if marks.get("wrapped"):
        return  # the chunk runs with its rows: a repeat is one (the schedule run twice in one block)
    chunks = marks.get("chunks")
    chunk = chunks[-1] if chunks else None
    if chunk is not None:
        name = f"module '{fqn}'" if fqn else "the root module"
        raise UnwrappedChunkError(
            f"keyinit.nn.keyed: {name} ({type(module).__name__}) runs micro-batch {chunk} of a "
            f"torch.distributed.pipelining schedule ({count} rows) as a repeat of rows an earlier micro-batch "
            "drew for: its masks would not be the unpipelined forward's. Give each micro-batch its rows with "
            "keyinit.nn.micro_batches(stage, ctx, batch_size=B, n_microbatches=M) around schedule.step()")
