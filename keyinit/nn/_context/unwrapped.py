"""A ``torch.distributed.pipelining`` schedule that drives a keyed stage without ``keyinit.nn.micro_batches``.

A schedule calls its stage's ``forward_one_chunk`` once per micro-batch, on rows ``0 .. m-1`` of each chunk: under
``keyed`` alone every chunk after the first holds rows that the first one drew for, so it would be keyed as a
repeat (spec 14.6) and draw other masks than the unpipelined forward, silently. :func:`refuse_unwrapped_chunk`,
called for a root forward that would be such a repeat, refuses it when a schedule's ``forward_one_chunk`` runs
it and no :class:`keyinit.nn.micro_batches` wrapper gives the chunk its rows; the stage's own error wraps
it, and :func:`surface_chunk_error` raises it again as the keyed block is left.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["UnwrappedChunkError", "refuse_unwrapped_chunk", "surface_chunk_error"]

_PIPELINING = os.sep + os.path.join("torch", "distributed", "pipelining") + os.sep
_WRAPPER = os.path.join("keyinit", "nn", "_context", "pipeline.py")


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
    frame, chunk = sys._getframe(1), None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward_one_chunk":
            if code.co_filename.endswith(_WRAPPER):
                return  # the chunk runs with its rows: a repeat is one (the schedule run twice in one block)
            if _PIPELINING in code.co_filename and chunk is None:
                chunk = frame.f_locals.get("fwd_chunk_id", "?")
        frame = frame.f_back
    if chunk is not None:
        name = f"module '{fqn}'" if fqn else "the root module"
        raise UnwrappedChunkError(
            f"keyinit.nn.keyed: {name} ({type(module).__name__}) runs micro-batch {chunk} of a "
            f"torch.distributed.pipelining schedule ({count} rows) as a repeat of rows an earlier micro-batch "
            "drew for: its masks would not be the unpipelined forward's. Give each micro-batch its rows with "
            "keyinit.nn.micro_batches(stage, ctx, batch_size=B, n_microbatches=M) around schedule.step()")
