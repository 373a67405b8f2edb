"""Pipeline schedules under :func:`keyinit.nn.keyed`: each micro-batch keyed with its own rows.

A ``torch.distributed.pipelining`` schedule splits a rank's batch along
dimension 0 into ``n_microbatches`` chunks (``torch.tensor_split``) and calls
its stage's ``forward_one_chunk(chunk_id, ...)`` once per chunk, in the order
its schedule chooses (GPipe, 1F1B, Interleaved1F1B, ...). The user's code is
not called per chunk, so :func:`micro_batches` wraps the stage: chunk ``i``'s
forward (and any recompute of it) runs inside ``ctx.micro_batch(offset_i)``,
``offset_i`` the number of rows of the chunks before it. Every micro-batch then
draws the masks that the unpipelined forward of the whole batch draws for its
rows, on every stage.
"""

from __future__ import annotations

from typing import Any

from keyinit.keys import as_int
from keyinit.nn._context.unwrapped import wrapped_chunk

__all__ = ["micro_batches", "chunk_offsets"]


def chunk_offsets(batch_size: int, n_microbatches: int) -> list[int]:
    """The first row of each of ``torch.tensor_split(range(batch_size), n_microbatches)``'s chunks."""
    batch_size = as_int(batch_size, "batch_size")
    n_microbatches = as_int(n_microbatches, "n_microbatches")
    if batch_size < 0 or n_microbatches < 1:
        raise ValueError(f"micro_batches: need batch_size >= 0 and n_microbatches >= 1, got {batch_size} and "
                         f"{n_microbatches}")
    base, extra = divmod(batch_size, n_microbatches)
    offsets, row = [], 0
    for i in range(n_microbatches):
        offsets.append(row)
        row += base + (1 if i < extra else 0)
    return offsets


class micro_batches:
    """Context manager: ``stage``'s micro-batches keyed by ``ctx`` with their rows of the batch.

    ``stage`` is a ``torch.distributed.pipelining.PipelineStage`` (any object with
    ``forward_one_chunk(chunk_id, ...)`` and ``submod``); ``ctx`` an entered
    :func:`keyinit.nn.keyed` context on ``stage.submod`` (its ``sample_offset`` the
    global index of this rank's first sample); ``batch_size`` the rows the schedule
    splits on this rank (the whole step's batch for this data-parallel rank) and
    ``n_microbatches`` the schedule's::

        with keyinit.nn.keyed(stage.submod, seed, step=step, sample_offset=dp_rank * B) as ctx, \\
                keyinit.nn.micro_batches(stage, ctx, batch_size=B, n_microbatches=M):
            schedule.step(x)          # or schedule.step() on the other stages

    Several stages of one rank (interleaved schedules) each need their
    own wrapper (and their own ``keyed`` on their ``submod``).
    """

    def __init__(self, stage: Any, ctx: Any, *, batch_size: int, n_microbatches: int) -> None:
        from keyinit.nn._context.keyed import Keyed

        if not callable(getattr(stage, "forward_one_chunk", None)):
            raise TypeError(f"micro_batches: stage must be a pipelining stage (with forward_one_chunk), got "
                            f"{type(stage).__name__}")
        if not isinstance(ctx, Keyed):
            raise TypeError(f"micro_batches: ctx must be the context keyinit.nn.keyed returns, got {type(ctx).__name__}")
        submod = getattr(stage, "submod", None)
        if submod is not None and ctx.model is not submod:
            raise ValueError("micro_batches: ctx keys another model than stage.submod; enter "
                             "keyinit.nn.keyed(stage.submod, ...) for this stage")
        self.stage, self.ctx = stage, ctx
        self.offsets = chunk_offsets(batch_size, n_microbatches)
        self._saved: Any = None

    def _offset(self, chunk_id: int) -> int:
        if not 0 <= chunk_id < len(self.offsets):
            raise IndexError(f"micro_batches: the schedule ran chunk {chunk_id}, but n_microbatches is "
                             f"{len(self.offsets)}: pass the schedule's n_microbatches")
        return self.offsets[chunk_id]

    def __enter__(self) -> "micro_batches":
        stage, ctx = self.stage, self.ctx
        original = stage.forward_one_chunk
        self._saved = stage.__dict__.get("forward_one_chunk")

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            ctx.probing = False
            try:
                with wrapped_chunk(), ctx.micro_batch(self._offset(fwd_chunk_id)):  # (keyinit.nn._context.unwrapped)
                    return original(fwd_chunk_id, *args, **kwargs)
            finally:
                ctx.probing = True

        stage.forward_one_chunk = forward_one_chunk
        # a forward of the stage outside a chunk is the schedule's shape inference: not a repeat of any rows
        ctx.probing = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.ctx.probing = False
        if self._saved is None:
            del self.stage.forward_one_chunk
        else:
            self.stage.forward_one_chunk = self._saved
