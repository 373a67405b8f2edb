"""``SamplePositions``: which global samples a (micro-)batch's rows are, and how a batch carries them.

A batch carries its positions as the attribute ``keyinit_samples`` (:data:`ATTRIBUTE`);
:func:`sample_positions` reads them from a :class:`SamplePositions` or from an object that carries one.
``keyinit.data`` makes and attaches them (``KeyedSampler.batch_sampler``, ``keyed_samples``,
``keyed_collate``: ``keyinit.data._positions``) and ``keyinit.nn.keyed(samples=)`` reads them; the class
is ``keyinit.data.SamplePositions`` to users.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from keyinit.keys import as_int_in

__all__ = ["SamplePositions", "sample_positions", "ATTRIBUTE"]

#: The attribute that carries a batch's :class:`SamplePositions`.
ATTRIBUTE = "keyinit_samples"


def _count(what: str, minimum: int) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        as_int_in(value, f"SamplePositions: {what}", minimum)
    return check


@attrs.frozen
class SamplePositions:
    """Rows ``0 .. rows - 1`` of a batch are global samples ``first .. first + rows - 1`` of step ``step``
    (global sample positions ``step * global_batch_size + first + r``, docs/spec.md 16.2)."""

    step: int = attrs.field(validator=_count("step", 0))
    first: int = attrs.field(validator=_count("first", 0))
    rows: int = attrs.field(validator=_count("rows", 0))
    global_batch_size: int = attrs.field(validator=_count("global_batch_size", 1))

    def __attrs_post_init__(self) -> None:
        if self.first + self.rows > self.global_batch_size:
            raise ValueError(f"SamplePositions: rows {self.first} .. {self.first + self.rows - 1} are not within "
                             f"the step's global batch of {self.global_batch_size}")

    def slice(self, start: int, stop: int) -> "SamplePositions":
        """The positions of rows ``start .. stop - 1`` (a micro-batch cut from this batch)."""
        start = as_int_in(start, "start", 0)
        stop = as_int_in(stop, "stop", start)
        if stop > self.rows:
            raise ValueError(f"SamplePositions.slice: stop must be at most rows={self.rows}, got {stop}")
        return SamplePositions(self.step, self.first + start, stop - start, self.global_batch_size)


def sample_positions(samples: Any) -> Optional[SamplePositions]:
    """The :class:`SamplePositions` ``samples`` is or carries, else None."""
    if isinstance(samples, SamplePositions):
        return samples
    try:
        found = object.__getattribute__(samples, "__dict__").get(ATTRIBUTE)
    except AttributeError:
        return None
    return found if isinstance(found, SamplePositions) else None
