"""What each aten op is to a capture (:mod:`keyinit._engine.capture.capture`): the op tables and schema facts.

Which ops fill, zero, copy, allocate or make constants; which are identities, concatenations, value
reads or data-dependent; which write which arguments; which views reinterpret memory; which code loads
data rather than initializing it; and the two exact conversions a write into a buffer needs
(:func:`fit`, :func:`convert`). Nothing here holds state but a cache of schema facts.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from keyinit import init as _init
from keyinit._engine.programs.program import Const, Node, Pointwise

__all__ = ['recognised', 'FILL_VALUE', 'ZERO', 'COPY', 'ALLOC', 'CONST_FACTORIES', 'FULL', 'IDENTITY', 'CAT', 'VALUE_OPS', 'DATA_DEPENDENT', 'mutated_args', 'op_name', 'INDEXING', 'REINTERPRETING', 'reinterprets', 'SET_STORAGE', 'LOADERS', 'LAZY_NEW', 'returns_self', 'is_kwarg_only', 'fit', 'convert', "aten"]

aten = torch.ops.aten


#: Init functions whose torch algorithm draws in a loop; recorded as keyinit's initializer.
def recognised() -> dict[types.CodeType, Callable[[dict], Any]]:
    nn_init = torch.nn.init
    table: dict[types.CodeType, Callable[[dict], Any]] = {}

    def trunc(loc: dict) -> Any:
        return _init.truncated_normal(mean=float(loc["mean"]), std=float(loc["std"]), a=float(loc["a"]), b=float(loc["b"]))

    def orthogonal(loc: dict) -> Any:
        return _init.orthogonal(gain=float(loc["gain"]))

    for name, make in (("trunc_normal_", trunc), ("_no_grad_trunc_normal_", trunc), ("orthogonal_", orthogonal)):
        fn = getattr(nn_init, name, None)
        if fn is not None:
            table[fn.__code__] = make
    return table


FILL_VALUE = {aten.fill_.Scalar, aten.fill.Scalar, aten.fill_.Tensor, aten.fill.Tensor}
ZERO = {aten.zero_.default, aten.zero.default}
COPY = {aten.copy_.default}
ALLOC = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
          aten.new_empty_strided.default, aten.empty_like.default, aten.empty_permuted.default}
CONST_FACTORIES = {
    aten.zeros.default: 0, aten.ones.default: 1, aten.zeros_like.default: 0, aten.ones_like.default: 1,
    aten.new_zeros.default: 0, aten.new_ones.default: 1,
}
FULL = {aten.full.default, aten.full_like.default, aten.new_full.default, aten.scalar_tensor.default}
IDENTITY = {aten.clone.default, aten._to_copy.default, aten.copy.default, aten.lift_fresh_copy.default,
             aten.lift_fresh.default, aten.alias_copy.default, aten.detach_copy.default, aten.to.dtype}
#: ``torch.tensor(data)``'s lift of a tensor made this moment from Python data (not a tensor from outside)
LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
CAT = {aten.cat.default: False, aten.stack.default: True}
#: Ops whose results are Python values (no tensors): computed on real values.
VALUE_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
#: Ops whose results (values or shapes) depend on their inputs' values: computed on real values too.
DATA_DEPENDENT = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}


def mutated_args(func: Any) -> list[str]:
    names = MUTATED.get(func)
    if names is None:
        names = MUTATED[func] = tuple(arg.name for arg in func._schema.arguments
                                       if arg.alias_info is not None and arg.alias_info.is_write)
    return list(names)


#: ``func -> names of the arguments it writes`` (a cache of schema facts, not state).
MUTATED: dict[Any, tuple[str, ...]] = {}


def op_name(func: Any) -> str:
    name = func._schema.name.replace("aten::", "")
    return name if func._overloadname == "default" else f"{name}.{func._overloadname}"



#: Ops that take a list of index tensors second, where a boolean mask selects elements.
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

#: Views whose values are not the elements of their buffer as stored (:func:`reinterprets`).
REINTERPRETING = "another dtype: view(dtype), view_as_real/complex; or conj()"


def reinterprets(view: torch.Tensor, base: torch.Tensor) -> bool:
    """A view that reads its memory otherwise than as ``base``'s elements: another dtype, or torch's lazy
    conjugate/negative bit."""
    return view.dtype != base.dtype or view.is_conj() != base.is_conj() or view.is_neg() != base.is_neg()


#: ``tensor.set_(memory, ...)``: a tensor made from real memory (a checkpoint's bytes), not init.
SET_STORAGE = {aten.set_.source_Storage, aten.set_.source_Storage_storage_offset, aten.set_.source_Tensor,
                aten.set_.source_Tensor_storage_offset}

#: Code whose tensors are data, not init: run for real under a capture (``timm.create_model(pretrained=True)``
#: from a local file loads a state dict in the constructor).
LOADERS = {torch.serialization.load.__code__, torch.serialization._load.__code__}
#: The constructors of a lazy module's shapeless tensors (``nn.LazyLinear``): their empty tensor is made for
#: real, so the built model is refused naming the module (:func:`keyinit._engine.planning.plan_checks.check_lazy`).
LAZY_NEW = {torch.nn.parameter.UninitializedParameter.__new__.__code__,
            torch.nn.parameter.UninitializedBuffer.__new__.__code__}


def returns_self(func: Any) -> bool:
    """``func`` is an in-place op on its first argument that returns it (``normal_``, ``uniform_``)."""
    schema = func._schema
    if len(schema.returns) != 1 or not schema.arguments:
        return False
    first, ret = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and first.is_write and ret is not None and ret.is_write and \
        set(first.before_set) == set(ret.before_set)


def is_kwarg_only(func: Any, name: str) -> bool:
    return any(a.name == name and a.kwarg_only for a in func._schema.arguments)


def fit(value: Node, meta: torch.Tensor) -> Node:
    if tuple(value.shape) == tuple(meta.shape) and value.dtype == meta.dtype:
        return value
    return convert(value, tuple(meta.shape), meta.dtype, "broadcast")


def convert(node: Node, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> Node:
    """``node`` broadcast to ``shape`` and converted to ``dtype`` (exact data movement)."""
    if tuple(node.shape) == tuple(shape) and node.dtype == dtype:
        return node
    if isinstance(node, Const):
        return Const(tuple(shape), dtype, node.value)
    return Pointwise(tuple(shape), dtype, lambda x: x.to(dtype), (node,), f"{name}:to", exact=True)
