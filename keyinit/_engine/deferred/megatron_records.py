"""What a :func:`keyinit.deferred` constructor gave the WHOLE of a megatron-core split parameter.

megatron's CPU initialization (``use_cpu_initialization``) draws a master weight of the global
shape and keeps this rank's chunks of it; its split biases are one constant. :func:`whole_node`
recognizes both in a constructor record and returns the program node of the whole tensor, so that
replaying it keyed gives every tensor-parallel layout the single-process values. Which rank holds
which chunk is :mod:`keyinit._sharding.megatron` (read through :func:`keyinit.layouts.target_for`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from keyinit.layouts import target_for
from keyinit._engine.programs.program import Alloc, Cat, Const, Read, StridedView, Write
from keyinit.regions import row_major_strides


def _copied_value(node: Any) -> Any:
    """``node`` with whole-buffer copies (``weight.data.copy_(x)``, ``torch.cat`` of one piece) unwrapped."""
    while True:
        if isinstance(node, Cat) and not node.stack and len(node.args) == 1:
            node = node.args[0]
            continue
        if not isinstance(node, Read) or not isinstance(node.version, Write):
            return node
        write = node.version
        whole = StridedView.contiguous(tuple(write.geometry.size))
        if not (isinstance(write.value, (Read, Cat)) and isinstance(write.prev, Alloc) and write.geometry == whole
                and node.geometry == whole and write.prev.storage.numel == whole.numel
                and write.value.dtype == node.dtype):
            return node
        node = write.value


def _block(geometry: Any, shape: tuple[int, ...]) -> Optional[list[range]]:
    """The index ranges a view ``geometry`` of a contiguous ``shape`` buffer selects, if it is a block."""
    strides = row_major_strides(shape)
    if len(geometry.size) != len(shape) or any(
            size > 1 and stride != whole for size, stride, whole in zip(geometry.size, geometry.stride, strides)):
        return None
    offset, ranges = int(geometry.offset), []
    for size, stride, extent in zip(geometry.size, strides, shape):
        start, offset = divmod(offset, stride)
        if start + size > extent:
            return None
        ranges.append(range(start, start + size))
    return ranges if offset == 0 else None


def whole_node(module: torch.nn.Module, name: str, tensor: torch.Tensor, fqn: str,
               value_node: Callable[[torch.Tensor], Any]) -> Any:
    """For :func:`keyinit.deferred`: the constructor's value of the WHOLE split parameter ``module.<name>``.

    ``None`` unless ``tensor`` is marked ``tensor_model_parallel`` and its constructor value is
    recognized as the part of a whole that its layout (:class:`keyinit.layouts.MegatronLayout`)
    says this rank holds. ``value_node`` turns a stand-in into its program node. Two shapes of
    constructor code are recognized:

    - megatron's CPU initialization: ``init_method`` ran on a master weight of the global shape and
      ``weight`` is a copy of chunks of it; the chunks are checked to be exactly the layout's
      region (also with ``partition_stride``), and the whole is the master weight;
    - one constant written over the whole local tensor (megatron zeroes its split biases): the
      whole is that constant over the global shape.
    """
    if not getattr(tensor, "tensor_model_parallel", False):
        return None
    node = value_node(tensor)
    try:
        region = target_for(tensor, fqn=fqn, module=module, name=name, allow_meta=True).region
    except (ValueError, TypeError):
        return None  # the planner reports the layout's error
    shape = tuple(region.shape)
    if isinstance(node, Read) and isinstance(node.version, Write) and isinstance(node.version.value, Const):
        write = node.version
        full = StridedView.contiguous(tuple(tensor.shape))
        if isinstance(write.prev, Alloc) and write.geometry == full == node.geometry \
                and write.prev.storage.numel == full.numel:
            return Const(shape, node.dtype, write.value.value)
        return None
    value = _copied_value(node)
    dim = int(getattr(tensor, "partition_dim", 0)) % len(shape)
    if isinstance(value, Cat) and not value.stack and value.dim % len(shape) == dim:
        pieces = value.args
    else:
        pieces = (value,)
    if not pieces or not all(isinstance(p, Read) and p.version is pieces[0].version for p in pieces):
        return None
    source = pieces[0].version
    if not isinstance(source, Write) or tuple(source.geometry.size) != shape \
            or source.geometry != StridedView.contiguous(shape) or _storage_numel(source) != source.geometry.numel:
        return None
    rows: list[int] = []
    for piece in pieces:
        block = _block(piece.geometry, shape)
        if block is None or any(r != range(n) for d, (r, n) in enumerate(zip(block, shape)) if d != dim):
            return None
        rows.extend(block[dim])
    if rows != [int(i) for i in region.indices[dim]] or any(
            len(region.indices[d]) != n for d, n in enumerate(shape) if d != dim):
        return None
    return Read(source, StridedView.contiguous(shape), pieces[0].dtype)


def _storage_numel(version: Any) -> int:
    while not isinstance(version, Alloc):
        version = version.prev
    return int(version.storage.numel)
