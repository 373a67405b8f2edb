"""Keyed dropout as a function: the mask is a pure function of (key, the element's global index).

.. math::

    \\mathrm{keep}_i = \\bigl[\\mathrm{word}(K, i) < \\mathrm{round}((1 - p)\\, 2^{32})\\bigr],
    \\qquad y_i = \\begin{cases} x_i / (1 - p) & \\mathrm{keep}_i \\\\ 0 & \\text{otherwise} \\end{cases}

where ``i`` is the element's row-major index in the GLOBAL tensor and
``keep`` is exactly ``keyinit.random.bernoulli(key, global_shape, p=1 - p)``.
The gradient is ``grad * keep / (1 - p)``, with the mask regenerated from the
key; no mask is stored. Exact arithmetic per dtype: ``docs/spec.md`` section 14.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from keyinit.keys import Key, require_key
from keyinit._draw.dropout_geometry import Layout, dtensor_layout, layout_for, rows_layout

__all__ = ["dropout", "scaled_dot_product_attention"]

FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_p(p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout probability must be a float in [0, 1], got {type(p).__name__} {p!r}")
    p = float(p)
    if not (math.isfinite(p) and 0.0 <= p <= 1.0):
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def check_input(input: Any) -> None:
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"dropout: input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"dropout: input must be float32, float64, bfloat16 or float16, got {input.dtype}"
        )


def _dtensor_class() -> Optional[type]:
    from keyinit.layouts import dtensor_class as find

    return find()


def is_dtensor(input: torch.Tensor) -> bool:
    if type(input) is torch.Tensor or type(input) is torch.nn.Parameter:
        return False  # (without looking DTensor up: torch.distributed's import costs a call's time)
    cls = _dtensor_class()
    return cls is not None and isinstance(input, cls)


def run_layout(local: torch.Tensor, p: float, key: Key, layout: Layout) -> torch.Tensor:
    """The ``keyinit::dropout`` op on ``local`` placed by ``layout``, under ``key`` (its words and its stream
    version, which the op keeps)."""
    return _op().call(local, key.k0, key.k1, p, layout.gstrides, layout.starts, layout.indices, key.stream,
                      layout.hstrides)


def _op() -> Any:
    """:mod:`keyinit.nn._ops.op` (imported on first use: it registers the custom op with torch). An import
    statement, which dynamo runs while it traces (``importlib.import_module`` it refuses to trace, so a
    first use inside ``torch.compile(fullgraph=True)`` failed)."""
    from keyinit.nn._ops import op

    return op


def _dtensor_dropout(input: torch.Tensor, p: float, key: Key, row_offset: int,
                     keyed_rows: bool = True) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    layout = dtensor_layout(input, row_offset, key.stream if keyed_rows else None)  # (v2 names keyed rows only)
    spec = input._spec
    out_local = run_layout(input.to_local(), p, key, layout)
    return DTensor.from_local(
        out_local, spec.mesh, spec.placements, run_check=False, shape=input.shape, stride=input.stride()
    )


def dropout(
    input: torch.Tensor,
    p: float,
    *,
    rng_key: Key,
    training: bool = True,
    global_shape: Optional[Sequence[int]] = None,
    region: Optional[Sequence[Any]] = None,
) -> torch.Tensor:
    """Keyed dropout: zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    The keep-mask is ``keyinit.random.bernoulli(rng_key, global_shape, p=1 - p)`` at the
    global elements ``input`` holds, so it does not depend on how the tensor is
    split, on the device or on the global RNG (which is never read):

    - a plain tensor is ``full[region]`` of a ``global_shape`` tensor, as for the
      samplers (default: the whole tensor, ``global_shape = input.shape``);
    - a DTensor takes its global shape and region from its placements (Shard,
      ``_StridedShard``, Replicate; Partial is an error) and returns a DTensor of
      the same placements, with no communication.

    ``p = 0`` or ``training=False`` returns ``input`` itself; ``p = 1`` gives zeros.
    Kept values are ``input * (1 / (1 - p))`` (binary32 arithmetic for 16-bit
    dtypes, then rounded); dropped ones are ``+0``. The backward is
    ``grad * keep / (1 - p)``, the mask regenerated from the key; nothing of the
    input's size is saved. Works under ``torch.compile(fullgraph=True)`` (the key is
    a compile-time constant; regions of step-1 slices).
    """
    p = check_p(p)
    key = require_key(rng_key, "rng_key")
    check_input(input)
    if is_dtensor(input):
        if global_shape is not None or region is not None:
            raise TypeError(
                "dropout: a DTensor's global shape and region come from its placements; "
                "pass global_shape/region only with a plain local tensor"
            )
        if not training or p == 0.0:
            return input
        return _dtensor_dropout(input, p, key, 0, keyed_rows=False)
    layout = layout_for(tuple(input.shape), global_shape, region)
    if not training or p == 0.0:
        return input
    return run_layout(input, p, key, layout)


def dropout_rows(input: torch.Tensor, p: float, key: Key, row_offset: int) -> torch.Tensor:
    """Dropout with dimension 0 read as the batch: local row ``r`` is global row ``row_offset + r``.

    What :func:`keyinit.nn.keyed` applies to every activation (``p`` in ``(0, 1]``).
    A DTensor's own row ``r`` (after its placements) is global row ``row_offset + r``.
    """
    if type(input) is torch.Tensor:  # (the common case: a plain activation; no DTensor lookup)
        if input.dtype not in FLOAT_DTYPES:
            check_input(input)
        return _op().call_rows(input, p, key, row_offset)
    check_input(input)
    if is_dtensor(input):
        return _dtensor_dropout(input, p, key, row_offset)
    return run_layout(input, p, key, rows_layout(tuple(input.shape), row_offset, key.stream))


def probs_drop(p: float, key: Key, layout: Optional[Layout], row_offset: int = 0):
    """The dropout of attention probabilities: by ``layout`` (plain) or by placements (DTensor)."""

    def drop(probs: torch.Tensor) -> torch.Tensor:
        if is_dtensor(probs):
            return _dtensor_dropout(probs, p, key, row_offset)
        if layout is None:
            return run_layout(probs, p, key, rows_layout(tuple(probs.shape), row_offset, key.stream))
        return run_layout(probs, p, key, layout)

    return drop


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    rng_key: Key,
    global_shape: Optional[Sequence[int]] = None,
    region: Optional[Sequence[Any]] = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with its attention dropout keyed by ``rng_key``.

    The attention probabilities ``P`` (shape ``(..., Lq, Lk)``) are dropped exactly as
    :func:`dropout` drops them: probability ``(b, h, i, j)`` is kept iff
    ``keyinit.random.bernoulli(rng_key, global_shape, p=1 - dropout_p)`` is True at
    its global index, where the local ``P`` is ``full[region]`` of a tensor of
    ``global_shape`` (default: the local shape). So a batch, head or query split
    (each shard passing its region) draws the same masks. ``is_causal`` compares
    the GLOBAL query and key positions the region gives. The matmuls and softmax
    are torch's (not batch-invariant bitwise); the backward regenerates the mask
    from the key. DTensor inputs take their regions from their placements.
    """
    p = check_p(dropout_p)
    rng_key = require_key(rng_key, "rng_key")
    for tensor in (query, key, value):
        check_input(tensor)
    from keyinit.nn._ops.attention import attend

    shape = (*query.shape[:-1], key.shape[-2])
    if is_dtensor(query):
        if global_shape is not None or region is not None:
            raise TypeError("scaled_dot_product_attention: DTensor inputs take their region from their placements")
        layout, positions = None, None
    else:
        layout = layout_for(shape, global_shape, region)
        positions = (layout.starts[-2], layout.indices[-2], layout.starts[-1], layout.indices[-1])
    drop = probs_drop(p, rng_key, layout) if p > 0.0 else None
    return attend(query, key, value, attn_mask, is_causal, scale, enable_gqa, drop, positions)[0]
