"""One mode that refuses random draws: before an op runs, ask whether it is refused, and let the owner raise.

:class:`RefuseDraws` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that, for every aten op
issued in its thread while it is pushed, asks ``refused(func, args, kwargs)`` (by default: the op draws
from a torch generator, :func:`keyinit._engine.programs.random_ops.is_random`) and, if so, calls ``refuse(func)``
BEFORE the op runs, so nothing is drawn and no generator advances; ``refuse`` raises the owner's own error.
Every other op runs as it would. Its users keep their messages and their tests:

- an initializer of the user's own (:mod:`keyinit._engine.programs.guard`): every draw;
- a thread that a capture or a keyed sample starts (:mod:`keyinit._engine.capture.outside`): every draw, and for a
  capture every op on a stand-in, while the block is open;
- a compiled forward traced outside ``keyed`` (``keyinit.nn.compile``): every draw that draws something.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch.utils._python_dispatch import TorchDispatchMode

from keyinit._engine.programs.random_ops import is_random

__all__ = ["RefuseDraws", "draws"]


def draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """The default test: ``func`` draws from a torch generator."""
    return is_random(func)


class RefuseDraws(TorchDispatchMode):
    """Refuse, before it runs, every op ``refused(func, args, kwargs)`` says (default :func:`draws`):
    ``refuse(func)`` raises; any other op runs."""

    def __init__(self, refuse: Callable[[Any], None],
                 refused: Optional[Callable[[Any, tuple, dict], bool]] = None) -> None:
        super().__init__()
        self.refuse = refuse
        self.refused = draws if refused is None else refused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if self.refused(func, args, kwargs):
            self.refuse(func)
        return func(*args, **kwargs)
