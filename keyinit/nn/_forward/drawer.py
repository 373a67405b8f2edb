"""What a keyed forward's draws become: one drawer per context, chosen when the context is built.

The draw sites of a keyed forward (the dropout family and attention dropout,
:mod:`keyinit.nn._forward.intercept`; every other random ATen op and the batch rules of the other ops,
:mod:`keyinit.nn._forward.modes`) call their context's drawer (``ctx.drawer``) and never ask which kind of
forward is running:

- :data:`EAGER` (a :class:`Drawer`): the eager keyed forward (``keyinit.nn.keyed``, and a graph of
  ``keyinit.nn.compile`` run eagerly): each draw is computed now, keyed values of real tensors, and the
  batch rules read the values they are given;
- the traced drawer of a graph ``keyinit.nn.compile`` traces (:class:`keyinit.nn._compiled.sites.Trace`, a
  subclass): each draw becomes a site, a call of one of the graph's custom ops whose keys are a graph input;
  the batch rules run on metadata only, and a draw that depends on values (rows picked by index values) is
  refused, so that the graph runs eagerly instead.

The host generators (Python's ``random``, ``numpy.random``: :mod:`keyinit.nn._forward.hostrandom`) are
keyed by the forward, not by a drawer: they are the same in both.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from keyinit.nn import functional as KF
from keyinit.nn._batch.propagate import propagate
from keyinit.nn._forward.intercept import keyed_masked

__all__ = ["Drawer", "EAGER"]


class Drawer:
    """The eager drawer: what each draw of a keyed forward computes now (see the module docstring)."""

    #: Draws are computed now, on real values: the fast paths that bypass the draw sites (a dropout without
    #: hooks, :mod:`keyinit.nn._forward.dropout`) and keyed dropout under ``torch.func.vmap`` apply only then.
    eager = True

    def masked(self, kind: str, mask: str, input: torch.Tensor, p: float, key: Any, rec: Any) -> torch.Tensor:
        """A call of the dropout family (``kind``, its ``mask``: "element", "feature" or an alpha form) with
        drop probability ``p`` and ``key`` on ``input``, whose batch is ``rec`` (None: replicated)."""
        return keyed_masked(kind, mask, input, p, key, rec)

    def rows_drop(self, p: float, key: Any, start: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The dropout of attention probabilities whose row 0 is global sample ``start``."""
        return KF.probs_drop(p, key, None, start)

    def values(self, func: Any, args: tuple, kwargs: dict, key: Any, batch: Any, site: str) -> Any:
        """``func(*args, **kwargs)``, a random ATen op, with keyinit's values for ``key``; ``batch`` is the output's
        batch (None: replicated; a :class:`keyinit.nn._batch.routed.Routed`: rows picked by values). ``site``
        names the draw in an error."""
        from keyinit.nn._forward.draws import keyed_draw

        return keyed_draw(func, args, kwargs, key, batch, site)

    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any, records: list) -> list:
        """The batch records of the outputs of ATen op ``func`` (:func:`keyinit.nn._batch.propagate.propagate`)."""
        return propagate(func, args, kwargs, out, records)

    def on_values(self, frame: Any, what: str) -> None:
        """``what``, a draw in ``frame`` (a :class:`keyinit.nn._forward.intercept.Frame`) on rows picked by index
        values, is about to be drawn: the eager drawer draws it."""


#: The drawer of every eager keyed forward.
EAGER = Drawer()
