r"""Initializers: keyed maps from a key to a parameter's values.

An initializer is an immutable, hashable value (an attrs-frozen
:class:`Initializer` subclass) called as ``init(key, target)``. It writes the
values of ``target.region`` of a tensor of global shape ``target.global_shape``
into ``target.out``. Every random initializer is element-local: it turns its
parameters and the GLOBAL shape into the parameters of one
:mod:`keyinit.random` sampler (in Python floats, which are IEEE binary64 with
correctly rounded ``+ - * / sqrt`` on every platform) and asks that sampler for
``target.region`` only, so a process computes just the elements it holds and
every layout produces the same bits.

Fans are always computed from the GLOBAL shape, never from a local shard.
By default they follow PyTorch's weight layout ``(out, in, *kernel)``::

    fan_in  = shape[1] * prod(shape[2:])
    fan_out = shape[0] * prod(shape[2:])

as ``torch.nn.init._calculate_fan_in_and_fan_out`` does; :class:`variance_scaling`
and its presets take ``in_axis``/``out_axis``/``batch_axis`` to describe other
layouts (``in_axis=-2, out_axis=-1`` gives JAX's convention for ``(..., in, out)``).

Dtypes. The random initializers (:class:`uniform`, :class:`normal`,
:class:`truncated_normal`, :class:`xavier_uniform`, :class:`xavier_normal`,
:class:`kaiming_uniform`, :class:`kaiming_normal`, :class:`variance_scaling`
and its presets, :class:`orthogonal`) fill float32, float64, bfloat16 and
float16 tensors; on any other dtype (integer, bool, complex, float8) they raise
a ``TypeError`` naming the tensor's FQN and dtype. The deterministic ones
(:class:`constant`, :func:`zeros`, :func:`ones`, :class:`eye`, :class:`dirac`)
fill tensors of any dtype; :class:`constant` refuses a value that the dtype
cannot hold exactly when the dtype is integer or bool (``constant(0.5)`` on an
int64 tensor is an error, not a silent truncation).

``element_local`` is False for initializers (:class:`orthogonal`) that must
draw the whole tensor on every process to produce any region of it; init_model
flags those in its report.

Initializers write under ``torch.no_grad()``, so ``target.out`` may be a
parameter that requires grad. No initializer reads or changes the global torch
RNG.

One module: it is the catalogue, one initializer per ``torch.nn.init`` function
(and the ``jax.nn.initializers`` presets), kept in one file so it reads like
``torch/nn/init.py``; what they share (the base class, parameter checks, fans,
gains and the keyed fills) is :mod:`keyinit._initializers.base`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar, Union

import attrs
import torch

from keyinit import random
from keyinit._initializers.base import (
    Axes,
    Initializer,
    fan_axes,
    empty,
    named_initializer,
    non_negative,
    normal_fill,
    real_number,
    require_float,
    target_fans,
    uniform_fill,
    calculate_fan_in_and_fan_out,
    calculate_gain,
)
from keyinit.keys import Key
from keyinit.layouts import Target

__all__ = [
    "Initializer",
    "calculate_gain",
    "calculate_fan_in_and_fan_out",
    "uniform",
    "normal",
    "truncated_normal",
    "constant",
    "zeros",
    "ones",
    "eye",
    "dirac",
    "xavier_uniform",
    "xavier_normal",
    "kaiming_uniform",
    "kaiming_normal",
    "variance_scaling",
    "lecun_normal",
    "lecun_uniform",
    "he_normal",
    "he_uniform",
    "glorot_normal",
    "glorot_uniform",
    "orthogonal",
    "with_zero_rows",
]

#: Elements of boolean workspace per chunk in the deterministic (eye, dirac) fills.
_MASK_CHUNK = 1 << 20

#: Standard deviation of the standard normal truncated to (-2, 2), as in JAX.
_TRUNCATED_NORMAL_STDDEV = 0.87962566103423978


# --------------------------------------------------------------------------- basic distributions


@attrs.frozen
class uniform(Initializer):  # noqa: N801 - named like torch.nn.init.uniform_
    r"""Values drawn from the uniform distribution :math:`\mathcal{U}(\text{low}, \text{high})`.

    As :func:`keyinit.random.uniform`: ``low + (high - low) * u`` in float32
    with a 24-bit ``u`` in ``[0, 1)``, rounded to the tensor's dtype.
    ``low == high`` fills the constant ``low``, as ``torch.nn.init.uniform_``.
    """

    low: float = attrs.field(default=0.0, validator=real_number)
    high: float = attrs.field(default=1.0, validator=real_number)

    def __attrs_post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"uniform: expected low <= high, got low={self.low}, high={self.high}")

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "uniform")
        uniform_fill(key, target, self.low, self.high)


@attrs.frozen
class normal(Initializer):  # noqa: N801 - named like torch.nn.init.normal_
    r"""Values drawn from the normal distribution :math:`\mathcal{N}(\text{mean}, \text{std}^2)`.

    As :func:`keyinit.random.normal` (inverse-CDF, float32, tails to about 6.3 std).
    """

    mean: float = attrs.field(default=0.0, validator=real_number)
    std: float = attrs.field(default=1.0, validator=[real_number, non_negative])

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "normal")
        normal_fill(key, target, self.mean, self.std)


@attrs.frozen
class truncated_normal(Initializer):  # noqa: N801 - torch.nn.init.trunc_normal_, named as the distribution
    r"""Values from :math:`\mathcal{N}(\text{mean}, \text{std}^2)` truncated to :math:`[a, b]`.

    ``torch.nn.init.trunc_normal_`` as an initializer, named like the distribution
    it draws (:func:`keyinit.random.truncated_normal`, ``docs/spec.md``): one name
    per distribution across keyinit. ``a`` and ``b`` are ABSOLUTE bounds, as in
    torch (not multiples of ``std``). Drawn by inversion: exactly the truncated
    distribution, one stream word per element, every value in ``[a, b]``.
    """

    mean: float = attrs.field(default=0.0, validator=real_number)
    std: float = attrs.field(default=1.0, validator=[real_number, non_negative])
    a: float = attrs.field(default=-2.0, validator=real_number)
    b: float = attrs.field(default=2.0, validator=real_number)

    def __attrs_post_init__(self) -> None:
        if not self.a < self.b:
            raise ValueError(f"truncated_normal: expected a < b, got a={self.a}, b={self.b}")

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "truncated_normal")
        with named_initializer(target.fqn):
            random.truncated_normal(
                key, target.global_shape, mean=self.mean, std=self.std, a=self.a, b=self.b,
                region=target.region, out=target.out,
            )


def trunc_normal(mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> truncated_normal:
    """Deprecated: the old name of :class:`truncated_normal` (the same initializer, the same values)."""
    warnings.warn("keyinit.init.trunc_normal is deprecated: use keyinit.init.truncated_normal (the same initializer; "
                  "keyinit names each distribution once)", DeprecationWarning, stacklevel=2)
    return truncated_normal(mean=mean, std=std, a=a, b=b)


# --------------------------------------------------------------------------- deterministic


def _constant_value(value: Any) -> None:
    """A bool, int or float (nan and infinities included: they are fine fills for float tensors)."""
    if not isinstance(value, (bool, int, float)):
        raise TypeError(f"constant: value must be a real number or a bool, got {type(value).__name__}")


@attrs.frozen
class constant(Initializer):  # noqa: N801 - named like torch.nn.init.constant_
    r"""Every element is :math:`\text{value}`.

    Works for any dtype. Floating-point and complex tensors receive ``value``
    rounded to their dtype (as ``Tensor.fill_``); integer and bool tensors
    require a value they hold exactly (``ValueError`` otherwise).
    """

    value: Union[int, float, bool] = attrs.field(default=0)

    def __attrs_post_init__(self) -> None:
        _constant_value(self.value)

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        out = target.out
        dtype = out.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            value = self.value
            exact = isinstance(value, int) or (math.isfinite(value) and float(value).is_integer())
            if exact:
                number = int(value)
                if dtype == torch.bool:
                    exact = number in (0, 1)
                else:
                    info = torch.iinfo(dtype)
                    exact = info.min <= number <= info.max
            if not exact:
                raise ValueError(f"{target.fqn}: constant value {value!r} cannot be stored exactly in a {dtype} tensor")
        out.fill_(self.value)


def zeros() -> constant:
    r"""Every element is :math:`0` (any dtype): ``constant(0)``."""
    return constant(0)


def ones() -> constant:
    r"""Every element is :math:`1` (any dtype): ``constant(1)``."""
    return constant(1)


def _mask_fill(target: Target, mask_rows: Any) -> None:
    """Write a boolean mask into ``target.out`` in chunks of rows (dim 0), converted to its dtype.

    ``mask_rows(row_indices)`` returns the mask of the region's rows with those global indices.
    """
    out = target.out
    rows = target.region.indices[0]
    if out.numel() == 0:
        return
    per_row = max(1, out.numel() // max(1, rows.numel()))
    step = max(1, _MASK_CHUNK // per_row)
    for start in range(0, rows.numel(), step):
        block = mask_rows(rows[start : start + step])
        out[start : start + step].copy_(block.to(out.device))


@attrs.frozen
class eye(Initializer):  # noqa: N801 - named like torch.nn.init.eye_
    r"""The 2-D identity: element :math:`(i, j)` is :math:`1` if :math:`i = j` else :math:`0`.

    Exactly ``torch.nn.init.eye_`` (also for non-square shapes). For a region
    with global row indices ``r`` and column indices ``c`` the local tensor is
    ``r[:, None] == c[None, :]``. Any dtype.
    """

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        if len(target.global_shape) != 2:
            raise ValueError(
                f"{target.fqn}: eye needs a 2-D tensor, got global shape {target.global_shape}"
            )
        cols = target.region.indices[1]
        _mask_fill(target, lambda rows: rows[:, None] == cols[None, :])


@attrs.frozen
class dirac(Initializer):  # noqa: N801 - named like torch.nn.init.dirac_
    r"""The Dirac delta for a {3, 4, 5}-D convolution weight ``(out, in, *kernel)``.

    Exactly ``torch.nn.init.dirac_``: with ``o = out // groups`` output channels
    per group, element ``(i, j, k_2, ..., k_{n-1})`` is :math:`1` when
    :math:`i \bmod o = j` and every :math:`k_d = \lfloor \text{kernel}_d / 2 \rfloor`,
    and :math:`0` otherwise, so each group of channels preserves as many input
    channels as it can (``min(o, in)``). Region-aware and of any dtype.
    """

    groups: int = attrs.field(default=1)

    @groups.validator
    def _check_groups(self, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"dirac: groups must be a positive int, got {value!r}")

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        shape = target.global_shape
        if len(shape) not in (3, 4, 5):
            raise ValueError(
                f"{target.fqn}: dirac needs a 3-, 4- or 5-D tensor, got global shape {shape}"
            )
        if shape[0] % self.groups != 0:
            raise ValueError(
                f"{target.fqn}: dim 0 of global shape {shape} must be divisible by groups={self.groups}"
            )
        per_group = shape[0] // self.groups
        indices = target.region.indices
        centre = torch.ones((1, 1), dtype=torch.bool, device="cpu")
        for dim in range(2, len(shape)):
            hit = indices[dim] == shape[dim] // 2
            centre = centre[..., None] & hit.reshape((1,) * centre.dim() + (-1,))
        cols = indices[1]

        def mask_rows(rows: torch.Tensor) -> torch.Tensor:
            channel = (rows[:, None] % per_group) == cols[None, :]
            return channel.reshape(channel.shape + (1,) * (len(shape) - 2)) & centre

        _mask_fill(target, mask_rows)


# --------------------------------------------------------------------------- fan-scaled


def _check_mode(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    valid_modes = ["fan_in", "fan_out"]
    if value not in valid_modes:
        raise ValueError(f"Mode {value} not supported, please use one of {valid_modes}")


@attrs.frozen
class xavier_uniform(Initializer):  # noqa: N801 - named like torch.nn.init.xavier_uniform_
    r"""Glorot/Xavier uniform: :math:`\mathcal{U}(-a, a)` with

    .. math::
        a = \text{gain} \times \sqrt{\frac{6}{\text{fan\_in} + \text{fan\_out}}}

    computed as torch does (``std = gain * sqrt(2 / (fan_in + fan_out))``,
    ``a = sqrt(3) * std``), fans from the global shape in torch's convention.
    """

    gain: float = attrs.field(default=1.0, validator=[real_number, non_negative])

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "xavier_uniform")
        fan_in, fan_out = target_fans(target)
        if empty(target):
            return
        std = self.gain * math.sqrt(2.0 / float(fan_in + fan_out))
        a = math.sqrt(3.0) * std
        uniform_fill(key, target, -a, a)


@attrs.frozen
class xavier_normal(Initializer):  # noqa: N801 - named like torch.nn.init.xavier_normal_
    r"""Glorot/Xavier normal: :math:`\mathcal{N}(0, \text{std}^2)` with

    .. math::
        \text{std} = \text{gain} \times \sqrt{\frac{2}{\text{fan\_in} + \text{fan\_out}}}

    fans from the global shape in torch's convention.
    """

    gain: float = attrs.field(default=1.0, validator=[real_number, non_negative])

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "xavier_normal")
        fan_in, fan_out = target_fans(target)
        if empty(target):
            return
        std = self.gain * math.sqrt(2.0 / float(fan_in + fan_out))
        normal_fill(key, target, 0.0, std)


@attrs.frozen
class kaiming_uniform(Initializer):  # noqa: N801 - named like torch.nn.init.kaiming_uniform_
    r"""He/Kaiming uniform: :math:`\mathcal{U}(-\text{bound}, \text{bound})` with

    .. math::
        \text{bound} = \text{gain} \times \sqrt{\frac{3}{\text{fan\_mode}}}

    ``gain = calculate_gain(nonlinearity, a)``; ``mode`` is ``"fan_in"``
    (default, preserves the forward variance) or ``"fan_out"`` (backward).
    Computed as torch does (``std = gain / sqrt(fan)``, ``bound = sqrt(3) * std``)
    from the global shape in torch's convention, so ``kaiming_uniform(a=math.sqrt(5))``
    is ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, the default of ``nn.Linear``
    and ``nn.ConvNd``. A tensor with no elements is left alone.
    """

    a: float = attrs.field(default=0, validator=real_number)
    mode: str = attrs.field(default="fan_in", validator=_check_mode)
    nonlinearity: str = attrs.field(default="leaky_relu")

    def __attrs_post_init__(self) -> None:
        calculate_gain(self.nonlinearity, self.a)  # validates the name

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "kaiming_uniform")
        fan_in, fan_out = target_fans(target)
        if empty(target):
            return
        fan = fan_in if self.mode == "fan_in" else fan_out
        std = calculate_gain(self.nonlinearity, self.a) / math.sqrt(fan)
        bound = math.sqrt(3.0) * std
        uniform_fill(key, target, -bound, bound)


@attrs.frozen
class kaiming_normal(Initializer):  # noqa: N801 - named like torch.nn.init.kaiming_normal_
    r"""He/Kaiming normal: :math:`\mathcal{N}(0, \text{std}^2)` with

    .. math::
        \text{std} = \frac{\text{gain}}{\sqrt{\text{fan\_mode}}}

    ``gain = calculate_gain(nonlinearity, a)``, fans from the global shape in
    torch's convention. A tensor with no elements is left alone.
    """

    a: float = attrs.field(default=0, validator=real_number)
    mode: str = attrs.field(default="fan_in", validator=_check_mode)
    nonlinearity: str = attrs.field(default="leaky_relu")

    def __attrs_post_init__(self) -> None:
        calculate_gain(self.nonlinearity, self.a)

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "kaiming_normal")
        fan_in, fan_out = target_fans(target)
        if empty(target):
            return
        fan = fan_in if self.mode == "fan_in" else fan_out
        std = calculate_gain(self.nonlinearity, self.a) / math.sqrt(fan)
        normal_fill(key, target, 0.0, std)


_VS_MODES = ("fan_in", "fan_out", "fan_avg")
_VS_DISTRIBUTIONS = ("truncated_normal", "normal", "uniform")


@attrs.frozen
class variance_scaling(Initializer):  # noqa: N801 - named like jax.nn.initializers.variance_scaling
    r"""JAX's ``variance_scaling``: values with variance :math:`\text{scale} / n`.

    ``n`` is ``fan_in``, ``fan_out`` or ``(fan_in + fan_out) / 2`` for ``mode``
    ``"fan_in"``, ``"fan_out"``, ``"fan_avg"``; with
    :math:`\sigma^2 = \text{scale} / n`, ``distribution`` is

    - ``"truncated_normal"``: :math:`\mathcal{N}(0, s^2)` truncated to
      :math:`[-2s, 2s]` with :math:`s = \sigma / 0.87962566103423978` (the
      standard deviation of a standard normal truncated to :math:`(-2, 2)`),
      so the variance is :math:`\sigma^2`;
    - ``"normal"``: :math:`\mathcal{N}(0, \sigma^2)`;
    - ``"uniform"``: :math:`\mathcal{U}(-\sqrt{3}\sigma, \sqrt{3}\sigma)`.

    Fans come from the GLOBAL shape via :func:`calculate_fan_in_and_fan_out`.
    DEFAULT AXES DIFFER FROM JAX: this is a PyTorch library, so the defaults
    ``in_axis=1, out_axis=0`` read weights in torch's ``(out, in, *kernel)``
    layout (``fan_in = in * prod(kernel)``), matching ``torch.nn.init``. Pass
    ``in_axis=-2, out_axis=-1`` for JAX's ``(..., in, out)`` layout (JAX's
    defaults); ``batch_axis`` dimensions count in neither fan.
    """

    scale: float = attrs.field(validator=real_number)
    mode: str = attrs.field()
    distribution: str = attrs.field()
    in_axis: Axes = attrs.field(default=1, converter=fan_axes)
    out_axis: Axes = attrs.field(default=0, converter=fan_axes)
    batch_axis: Axes = attrs.field(default=(), converter=fan_axes)

    def __attrs_post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"variance_scaling: scale must be positive, got {self.scale}")
        if self.mode not in _VS_MODES:
            raise ValueError(f"invalid mode for variance scaling initializer: {self.mode}")
        if self.distribution not in _VS_DISTRIBUTIONS:
            raise ValueError(f"invalid distribution for variance scaling initializer: {self.distribution}")

    def variance(self, global_shape: Sequence[int]) -> float:
        """The target variance ``scale / n`` for a tensor of this global shape."""
        fan_in, fan_out = calculate_fan_in_and_fan_out(global_shape, self.in_axis, self.out_axis, self.batch_axis)
        if self.mode == "fan_in":
            denominator = float(fan_in)
        elif self.mode == "fan_out":
            denominator = float(fan_out)
        else:
            denominator = (fan_in + fan_out) / 2
        return self.scale / denominator

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "variance_scaling")
        target_fans(target, self.in_axis, self.out_axis, self.batch_axis)  # errors name the FQN
        if empty(target):
            return
        variance = self.variance(target.global_shape)
        if self.distribution == "truncated_normal":
            stddev = math.sqrt(variance) / _TRUNCATED_NORMAL_STDDEV
            with named_initializer(target.fqn):
                random.truncated_normal(
                    key, target.global_shape, mean=0.0, std=stddev, a=-2.0 * stddev, b=2.0 * stddev,
                    region=target.region, out=target.out,
                )
        elif self.distribution == "normal":
            normal_fill(key, target, 0.0, math.sqrt(variance))
        else:
            limit = math.sqrt(3.0 * variance)
            uniform_fill(key, target, -limit, limit)


def lecun_normal(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""LeCun normal: ``variance_scaling(1.0, "fan_in", "truncated_normal")`` (variance :math:`1/\text{fan\_in}`)."""
    return variance_scaling(1.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis)


def lecun_uniform(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""LeCun uniform: ``variance_scaling(1.0, "fan_in", "uniform")``, i.e. :math:`\mathcal{U}(\pm\sqrt{3/\text{fan\_in}})`."""
    return variance_scaling(1.0, "fan_in", "uniform", in_axis, out_axis, batch_axis)


def he_normal(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""He normal: ``variance_scaling(2.0, "fan_in", "truncated_normal")`` (variance :math:`2/\text{fan\_in}`)."""
    return variance_scaling(2.0, "fan_in", "truncated_normal", in_axis, out_axis, batch_axis)


def he_uniform(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""He uniform: ``variance_scaling(2.0, "fan_in", "uniform")``, i.e. :math:`\mathcal{U}(\pm\sqrt{6/\text{fan\_in}})`."""
    return variance_scaling(2.0, "fan_in", "uniform", in_axis, out_axis, batch_axis)


def glorot_normal(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""Glorot normal: ``variance_scaling(1.0, "fan_avg", "truncated_normal")`` (variance :math:`2/(\text{fan\_in}+\text{fan\_out})`).

    As in JAX this is TRUNCATED at two (corrected) standard deviations, unlike
    :class:`xavier_normal`, which is torch's untruncated normal.
    """
    return variance_scaling(1.0, "fan_avg", "truncated_normal", in_axis, out_axis, batch_axis)


def glorot_uniform(in_axis: Axes = 1, out_axis: Axes = 0, batch_axis: Axes = ()) -> variance_scaling:
    r"""Glorot uniform: ``variance_scaling(1.0, "fan_avg", "uniform")``; the same distribution as ``xavier_uniform()``."""
    return variance_scaling(1.0, "fan_avg", "uniform", in_axis, out_axis, batch_axis)


# --------------------------------------------------------------------------- not element-local


def _take_region(full: torch.Tensor, target: Target) -> torch.Tensor:
    block = full
    for dim, index in enumerate(target.region.indices):
        block = block.index_select(dim, index)
    return block


@attrs.frozen
class orthogonal(Initializer):  # noqa: N801 - named like torch.nn.init.orthogonal_
    r"""A (semi-)orthogonal matrix times ``gain``, as ``torch.nn.init.orthogonal_``.

    With ``rows = shape[0]`` and ``cols = numel // rows`` (trailing dimensions
    flattened): draw :math:`A` = ``keyinit.random.normal(key, (rows, cols))``
    (float32, widened to float64), transpose it if ``rows < cols``, factor
    :math:`A = QR` in float64 on the CPU, fix signs so the factorization is
    unique, :math:`Q \leftarrow Q \,\mathrm{diag}(\mathrm{sign}(\mathrm{diag}(R)))`
    (Mezzadri 2007, which makes :math:`Q` Haar-distributed), transpose back and
    multiply by ``gain``; then round to the tensor's dtype.

    NOT element-local (``element_local = False``): every process draws and
    factors the whole ``rows x cols`` matrix (memory and time of the full
    tensor) to write its region. The result is layout-invariant on one
    machine and torch build, but QR runs in LAPACK, whose bits may differ across
    LAPACK/BLAS builds, CPU kinds, thread counts and platforms: values are NOT
    promised to be bit-identical across platforms (the normal draw is).
    """

    element_local: ClassVar[bool] = False

    gain: float = attrs.field(default=1.0, validator=[real_number, non_negative])

    def matrix(self, key: Key, global_shape: Sequence[int]) -> torch.Tensor:
        """The full float64 result for ``global_shape`` (at least 2-D, no zero sizes)."""
        rows = global_shape[0]
        cols = math.prod(global_shape) // rows
        flattened = random.normal(key, (rows, cols), dtype=torch.float32).to(torch.float64)
        if rows < cols:
            flattened = flattened.t()
        q, r = torch.linalg.qr(flattened)
        q = q * torch.diagonal(r, 0).sign()
        if rows < cols:
            q = q.t()
        return (q * self.gain).reshape(tuple(global_shape))

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        require_float(target, "orthogonal")
        shape = target.global_shape
        if len(shape) < 2:
            raise ValueError(
                f"{target.fqn}: orthogonal needs a tensor with 2 or more dimensions, got global shape {shape}"
            )
        if empty(target) or target.out.numel() == 0:
            return
        full = self.matrix(key, shape)
        target.out.copy_(_take_region(full, target).to(target.out.device))


# --------------------------------------------------------------------------- composites


def _rows(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return tuple(value)
    raise TypeError(f"with_zero_rows: rows must be an int or a sequence of ints, got {value!r}")


@attrs.frozen
class with_zero_rows(Initializer):  # noqa: N801 - lower case like the other initializers
    r"""``base``'s values, with the given rows (indices along dim 0) set to :math:`0`.

    ``nn.Embedding``'s default is ``with_zero_rows(normal(), padding_idx)``:
    ``normal_`` then zero the padding row. Region-aware: only the listed rows
    that the region holds are zeroed. Negative rows count from the end of the
    global dim 0. ``element_local`` is ``base``'s.
    """

    base: Initializer = attrs.field()
    rows: tuple[int, ...] = attrs.field(converter=_rows)

    @base.validator
    def _check_base(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, Initializer):
            raise TypeError(f"with_zero_rows: base must be an Initializer, got {type(value).__name__}")

    @property
    def element_local(self) -> bool:  # type: ignore[override]
        return self.base.element_local

    @torch.no_grad()
    def __call__(self, key: Key, target: Target) -> None:
        shape = target.global_shape
        if len(shape) < 1:
            raise ValueError(f"{target.fqn}: with_zero_rows needs a tensor with at least 1 dimension")
        for row in self.rows:
            if not -shape[0] <= row < shape[0]:
                raise IndexError(f"{target.fqn}: row {row} is out of range for global shape {shape}")
        self.base(key, target)
        wanted = torch.tensor([row % shape[0] for row in self.rows], dtype=torch.int64, device="cpu")
        hit = torch.isin(target.region.indices[0], wanted)
        if bool(hit.any()):
            target.out[hit.to(target.out.device)] = 0
