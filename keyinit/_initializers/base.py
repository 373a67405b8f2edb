r"""The base of :mod:`keyinit.init`: the :class:`Initializer` protocol, the checks of its
parameters, fans and gains from the GLOBAL shape, and the keyed fills every initializer shares.

:mod:`keyinit.init` re-exports the public names (``Initializer``, ``calculate_fan_in_and_fan_out``,
``calculate_gain``) and holds the initializers themselves, one per ``torch.nn.init`` function.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Union

import attrs

from keyinit import random
from keyinit.distributions import FLOAT_DTYPES
from keyinit.keys import Key
from keyinit.layouts import Target

__all__ = ["Axes", "Initializer", "calculate_fan_in_and_fan_out", "calculate_gain", "real_number", "non_negative", "fan_axes",
           "require_float", "named_initializer", "target_fans", "uniform_fill", "normal_fill", "empty"]

Axes = Union[int, tuple[int, ...]]


class Initializer:
    """Base class: ``__call__(key, target)`` fills ``target.out``.

    Subclasses are attrs-frozen values: immutable, hashable, compared by their
    parameters and shown by a readable repr. ``element_local`` says whether
    producing a region costs only that region's elements.
    """

    element_local: ClassVar[bool] = True

    def __call__(self, key: Key, target: Target) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------- helpers


def real_number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: a finite int or float (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{type(instance).__name__}: {attribute.name} must be a real number, got {type(value).__name__}"
        )
    if not math.isfinite(value):
        raise ValueError(f"{type(instance).__name__}: {attribute.name} must be finite, got {value}")


def non_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value < 0:
        raise ValueError(f"{type(instance).__name__}: {attribute.name} must be >= 0, got {value}")


def fan_axes(value: Any) -> Axes:
    """attrs converter: an int, or a tuple of ints from any sequence of ints."""
    if isinstance(value, bool):
        raise TypeError(f"axes must be an int or a sequence of ints, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise TypeError(f"axes must be an int or a sequence of ints, got {value!r}")
        return tuple(value)
    raise TypeError(f"axes must be an int or a sequence of ints, got {value!r}")


def require_float(target: Target, name: str) -> None:
    dtype = target.out.dtype
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{target.fqn}: {name} draws floating-point values and cannot fill a {dtype} tensor "
            f"(supported: float32, float64, bfloat16, float16)"
        )


@contextlib.contextmanager
def named_initializer(fqn: str) -> Iterator[None]:
    """Prefix errors raised by a sampler with the tensor's FQN."""
    try:
        yield
    except (ValueError, TypeError) as error:
        raise type(error)(f"{fqn}: {error}") from error


def _normalize_axes(axes: Axes, ndim: int, what: str) -> tuple[int, ...]:
    listed = (axes,) if isinstance(axes, int) else axes
    result = []
    for axis in listed:
        if not -ndim <= axis < ndim:
            raise ValueError(f"{what} {axis} is out of range for a {ndim}-D tensor")
        result.append(axis % ndim)
    return tuple(result)


def calculate_fan_in_and_fan_out(
    shape: Sequence[int], in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()
) -> tuple[int, int]:
    r"""``(fan_in, fan_out)`` of a weight of (global) shape ``shape``.

    .. math::
        \text{fan\_in} = \text{in\_size} \times \text{receptive\_field}, \qquad
        \text{fan\_out} = \text{out\_size} \times \text{receptive\_field}

    where ``in_size``/``out_size`` are the products of the sizes of the
    ``in_axis``/``out_axis`` dimensions and ``receptive_field`` is the product of
    the dimensions in none of ``in_axis``, ``out_axis``, ``batch_axis``. The
    defaults ``in_axis=1, out_axis=0`` are PyTorch's convention for
    ``(out, in, *kernel)`` weights (``torch.nn.init._calculate_fan_in_and_fan_out``);
    ``in_axis=-2, out_axis=-1`` is JAX's (``jax.nn.initializers`` ``_compute_fans``).
    Sizes are multiplied as integers, so fans are exact.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(
            f"fan in and fan out can not be computed for a tensor with fewer than 2 dimensions, "
            f"got shape {shape}"
        )
    ins = _normalize_axes(fan_axes(in_axis), len(shape), "in_axis")
    outs = _normalize_axes(fan_axes(out_axis), len(shape), "out_axis")
    batches = _normalize_axes(fan_axes(batch_axis), len(shape), "batch_axis")
    used = [*ins, *outs, *batches]
    if len(set(used)) != len(used):
        raise ValueError(
            f"in_axis {in_axis}, out_axis {out_axis} and batch_axis {batch_axis} must name distinct dimensions"
        )
    receptive = math.prod(s for d, s in enumerate(shape) if d not in used)
    return math.prod(shape[d] for d in ins) * receptive, math.prod(shape[d] for d in outs) * receptive


def target_fans(target: Target, in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> tuple[int, int]:
    try:
        return calculate_fan_in_and_fan_out(target.global_shape, in_axis, out_axis, batch_axis)
    except ValueError as error:
        raise ValueError(f"{target.fqn}: {error}") from None


def calculate_gain(nonlinearity: str, param: Union[int, float, None] = None) -> float:
    r"""The recommended gain for a nonlinearity, as ``torch.nn.init.calculate_gain``.

    ================= ====================================================
    nonlinearity      gain
    ================= ====================================================
    Linear / Identity :math:`1`
    Conv{1,2,3}D      :math:`1`
    Sigmoid           :math:`1`
    Tanh              :math:`\frac{5}{3}`
    ReLU              :math:`\sqrt{2}`
    Leaky Relu        :math:`\sqrt{\frac{2}{1 + \text{negative\_slope}^2}}`
    SELU              :math:`\frac{3}{4}`
    ================= ====================================================

    ``param`` is leaky_relu's negative slope (default 0.01); other
    nonlinearities ignore it. Unknown names raise ``ValueError``.
    """
    linear_fns = (
        "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    )
    if nonlinearity in linear_fns or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            negative_slope = 0.01
        elif (not isinstance(param, bool) and isinstance(param, int)) or isinstance(param, float):
            negative_slope = param
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + negative_slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


def uniform_fill(key: Key, target: Target, low: float, high: float) -> None:
    """``U(low, high)`` into the target; ``low == high`` gives the constant ``low`` (as torch's ``uniform_``)."""
    if low == high:
        target.out.fill_(low)
        return
    with named_initializer(target.fqn):
        random.uniform(key, target.global_shape, low=low, high=high, region=target.region, out=target.out)


def normal_fill(key: Key, target: Target, mean: float, std: float) -> None:
    with named_initializer(target.fqn):
        random.normal(key, target.global_shape, mean=mean, std=std, region=target.region, out=target.out)


def empty(target: Target) -> bool:
    return math.prod(target.global_shape) == 0
