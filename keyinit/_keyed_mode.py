"""Keyed execution of existing init code (``reset_parameters``, ``init_weights``, ``_init_weights``).

Inside :class:`KeyedInitMode` (a ``TorchFunctionMode``), every random fill of
a model tensor is replaced by keyinit's keyed equivalent for that tensor's
canonical FQN, over its GLOBAL shape and local region:

* ``nn.init.uniform_/normal_/kaiming_uniform_`` arrive whole and are keyed whole.
* ``Tensor.uniform_/normal_`` on a model tensor are keyed. When they run inside
  ``nn.init.trunc_normal_``, ``xavier_uniform_``, ``xavier_normal_``,
  ``kaiming_normal_`` or ``kaiming_uniform_`` (which do not dispatch whole), the enclosing frame's
  arguments are read and the whole initializer is keyed instead, with fans from
  the global shape. Later random calls on temporaries inside that same
  ``trunc_normal_`` frame (its rejection loop) are answered with zeros, which
  its acceptance test treats as "accept"; keyed values already lie in ``[a, b]``.
* Deterministic ops (``fill_``, ``zero_``, ``copy_``, arithmetic) run unchanged.
* Any other random op (on a temporary, or one this mode cannot key) raises
  :class:`UnkeyedRandomnessError` naming the module, instead of silently drawing from
  the global torch RNG.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from keyinit.errors import UnkeyedRandomnessError

__all__ = ["KeyedInitMode", "UnkeyedRandomnessError"]

_init = torch.nn.init




def _random_functions() -> frozenset:
    names = [
        "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
        "poisson", "rand_like", "randn_like", "randint_like", "binomial",
    ]
    funcs = [getattr(torch, n) for n in names if hasattr(torch, n)]
    tensor_methods = [
        "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_",
        "log_normal_", "cauchy_", "bernoulli", "multinomial",
    ]
    funcs += [getattr(torch.Tensor, n) for n in tensor_methods if hasattr(torch.Tensor, n)]
    funcs += [torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
              torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
              torch.nn.functional.feature_alpha_dropout]
    return frozenset(funcs)


def _frame_codes() -> dict[types.CodeType, str]:
    table = {
        "_no_grad_trunc_normal_": "trunc_normal_",
        "trunc_normal_": "trunc_normal_",
        "xavier_uniform_": "xavier_uniform_",
        "xavier_normal_": "xavier_normal_",
        "kaiming_normal_": "kaiming_normal_",
        "kaiming_uniform_": "kaiming_uniform_",
    }
    return {getattr(_init, name).__code__: kind for name, kind in table.items() if hasattr(_init, name)}


def _argument(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


class KeyedInitMode(TorchFunctionMode):
    """Routes random fills of known tensors to keyed initializers.

    ``lookup(tensor)`` returns an opaque handle for a model tensor (or None);
    ``write(handle, initializer)`` fills it with a keyinit initializer;
    ``context()`` names the module whose code is running, for errors.
    """

    def __init__(
        self,
        lookup: Callable[[torch.Tensor], Optional[object]],
        write: Callable[[object, object], None],
        context: Callable[[], str],
    ) -> None:
        super().__init__()
        self._lookup = lookup
        self._write = write
        self._context = context
        self._random = _random_functions()
        self._frames = _frame_codes()
        self._keyed_frames: set[int] = set()  # ids of trunc_normal_ frames already keyed

    # -- helpers -----------------------------------------------------------------
    def _enclosing_init(self, tensor: torch.Tensor) -> Optional[tuple[str, types.FrameType]]:
        frame = sys._getframe(2)
        while frame is not None:
            kind = self._frames.get(frame.f_code)
            if kind is not None and frame.f_locals.get("tensor") is tensor:
                return kind, frame
            frame = frame.f_back
        return None

    def _inside_keyed_trunc_frame(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if id(frame) in self._keyed_frames and self._frames.get(frame.f_code) == "trunc_normal_":
                return True
            frame = frame.f_back
        return False

    def _from_frame(self, kind: str, frame: types.FrameType):
        from keyinit import init

        loc = frame.f_locals
        if kind == "trunc_normal_":
            self._keyed_frames.add(id(frame))
            return init.trunc_normal(mean=loc["mean"], std=loc["std"], a=loc["a"], b=loc["b"])
        if kind == "xavier_uniform_":
            return init.xavier_uniform(gain=loc["gain"])
        if kind == "xavier_normal_":
            return init.xavier_normal(gain=loc["gain"])
        if kind == "kaiming_normal_":
            return init.kaiming_normal(a=loc["a"], mode=loc["mode"], nonlinearity=loc["nonlinearity"])
        return init.kaiming_uniform(a=loc["a"], mode=loc["mode"], nonlinearity=loc["nonlinearity"])

    # -- dispatch ----------------------------------------------------------------
    def __torch_function__(self, func, types_, args=(), kwargs=None):  # noqa: C901 - one dispatch table
        kwargs = kwargs or {}
        from keyinit import init

        if func is _init.uniform_ or func is _init.normal_ or func is _init.kaiming_uniform_:
            tensor = _argument(args, kwargs, 0, "tensor", None)
            handle = self._lookup(tensor) if isinstance(tensor, torch.Tensor) else None
            if handle is not None:
                if func is _init.uniform_:
                    chosen = init.uniform(low=_argument(args, kwargs, 1, "a", 0.0), high=_argument(args, kwargs, 2, "b", 1.0))
                elif func is _init.normal_:
                    chosen = init.normal(mean=_argument(args, kwargs, 1, "mean", 0.0), std=_argument(args, kwargs, 2, "std", 1.0))
                else:
                    chosen = init.kaiming_uniform(
                        a=_argument(args, kwargs, 1, "a", 0.0),
                        mode=_argument(args, kwargs, 2, "mode", "fan_in"),
                        nonlinearity=_argument(args, kwargs, 3, "nonlinearity", "leaky_relu"),
                    )
                self._write(handle, chosen)
                return tensor
            return func(*args, **kwargs)

        if func in self._random:
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            handle = self._lookup(tensor) if tensor is not None else None
            is_fill = func is torch.Tensor.uniform_ or func is torch.Tensor.normal_
            if handle is not None and is_fill:
                enclosing = self._enclosing_init(tensor)
                if enclosing is not None:
                    chosen = self._from_frame(*enclosing)
                elif func is torch.Tensor.uniform_:
                    chosen = init.uniform(low=_argument(args, kwargs, 1, "from", 0.0), high=_argument(args, kwargs, 2, "to", 1.0))
                else:
                    chosen = init.normal(mean=_argument(args, kwargs, 1, "mean", 0.0), std=_argument(args, kwargs, 2, "std", 1.0))
                self._write(handle, chosen)
                return tensor
            if handle is None and is_fill and self._inside_keyed_trunc_frame():
                return tensor.zero_()
            if handle is None and kwargs.get("generator") is not None:
                return func(*args, **kwargs)  # the caller's own generator: not the global RNG
            what = getattr(func, "__name__", repr(func))
            target = "a model tensor" if handle is not None else "a temporary tensor"
            raise UnkeyedRandomnessError(
                f"{self._context()}: init code called {what}() on {target}; keyinit can key only "
                f"nn.init.* and in-place uniform_/normal_ on the module's own parameters and buffers. "
                f"Register a keyinit rule for this module (keyinit.register) instead of drawing from "
                f"the global torch RNG."
            )
        return func(*args, **kwargs)
