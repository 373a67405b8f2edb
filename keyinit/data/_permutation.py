"""``permutation`` and ``inverse_permutation``: a keyed bijection of ``range(n)`` with random access.

Values are those of :mod:`keyinit._draw.reference_permutation` (``docs/spec.md`` section 16);
:func:`keyinit._draw.dispatch.permute` runs them: CPU tensors through the compiled
kernel, CUDA tensors through the Triton kernel when triton is installed,
anything else through the reference. All three give the same bits.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from keyinit._draw import dispatch
from keyinit._draw import reference_permutation
from keyinit.keys import Key, as_int_in, require_key

__all__ = ["permutation", "inverse_permutation", "Positions"]

Positions = Union[torch.Tensor, range, slice, None]
DeviceLike = Union[torch.device, str, None]


def _check_n(n: object) -> int:
    return as_int_in(n, "n", 0, reference_permutation.MAX_N + 1, "an int in [0, 2**62]")


def _as_range(positions: Union[range, slice, None], n: int, what: str) -> range:
    if positions is None:
        return range(n)
    if isinstance(positions, slice):
        return range(*positions.indices(n))
    r = positions
    if len(r) and not (0 <= r[0] < n and 0 <= r[-1] < n):
        raise ValueError(f"{what} must lie in [0, {n}), got {r}")
    return r


def _meta(inverse: bool, where: str) -> ValueError:
    name = "inverse_permutation" if inverse else "permutation"
    return ValueError(f"keyinit.data.{name}: the result would be on the meta device ({where}), which holds no "
                      f"values; pass device='cpu' (or another device with memory)")


def _refuse_meta(positions: Positions, device: DeviceLike, inverse: bool, what: str) -> None:
    """A clear error where the result would be on the meta device (torch's own kernels fail there)."""
    if device is not None:
        if torch.device(device).type == "meta":
            raise _meta(inverse, "device='meta' was asked for")
    elif isinstance(positions, torch.Tensor):
        if positions.device.type == "meta" and type(positions) in (torch.Tensor, torch.nn.Parameter):
            raise _meta(inverse, f"the {what} tensor is on it")
    elif torch.get_default_device().type == "meta":
        raise _meta(inverse, "the default device, inside `with torch.device('meta')`")


def _run(key: Key, n: int, positions: Positions, device: DeviceLike, inverse: bool, what: str) -> torch.Tensor:
    key = require_key(key)
    n = _check_n(n)
    _refuse_meta(positions, device, inverse, what)
    if torch.get_default_device().type == "meta":
        with torch.device("cpu"):  # the result is on a real device: the kernels' own temporaries must be too
            return _run(key, n, positions, device, inverse, what)
    if isinstance(positions, (range, slice)) or positions is None:
        r = _as_range(positions, n, what)
        out = torch.empty(len(r), dtype=torch.int64, device=device)
        indexed = None
        start, step = r.start, r.step
    else:
        if not isinstance(positions, torch.Tensor):
            try:  # no dtype=: a float in a list must be an error below, not truncated to an int
                positions = torch.as_tensor(positions)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"{what} must be a tensor of ints, a range, a slice or None, "
                                f"got {type(positions).__name__}") from None
            if positions.numel() == 0:  # [] is a float tensor to torch
                positions = positions.to(torch.int64)
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TypeError(f"{what} must hold integers, got a {positions.dtype} tensor")
        if device is not None:
            positions = positions.to(device)
        indexed = positions.to(torch.int64).contiguous()
        if indexed.numel():
            low, high = int(indexed.min()), int(indexed.max())
            if low < 0 or high >= n:
                raise ValueError(f"{what} must lie in [0, {n}), got values in [{low}, {high}]")
        out = torch.empty(indexed.shape, dtype=torch.int64, device=indexed.device)
        start, step = 0, 1
    if out.numel() == 0:
        return out
    if n == 1:
        return out.zero_()
    return dispatch.permute(key, n, inverse, out, positions=indexed, start=start, step=step)


def permutation(key: Key, n: int, positions: Positions = None, *, device: DeviceLike = None) -> torch.Tensor:
    """``perm[positions]``, where ``perm`` is the keyed random permutation of ``range(n)``.

    ``n`` is an int in ``[0, 2**62]`` (``n = 0``: the empty permutation). ``positions`` is a
    tensor of ints (any shape; the result has its shape and device unless ``device`` is given),
    a ``range`` or a ``slice`` of ``range(n)``, or ``None`` for the whole permutation. Only the
    requested positions are computed: time and memory are proportional to their number, never to ``n``.
    The values are a pure function of ``(key, n, position)`` (``docs/spec.md`` section 16).
    """
    return _run(key, n, positions, device, False, "positions")


def inverse_permutation(key: Key, n: int, values: Positions = None, *, device: DeviceLike = None) -> torch.Tensor:
    """The position of each of ``values`` in ``permutation(key, n)``:
    ``permutation(key, n, inverse_permutation(key, n, v)) == v``."""
    return _run(key, n, values, device, True, "values")
