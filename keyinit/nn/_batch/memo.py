"""Replayed batch records: a torch function's output records, learned once per signature, set without the
dispatch mode.

Tracking the batch costs a trip through Python for every ATen op of a keyed
forward (:class:`keyinit.nn._forward.modes.BatchMode`); a small model's forward is
mostly those trips. Yet for most torch functions a model calls (``F.linear``,
``matmul``, ``rms_norm``, ``softmax``, ``view``, ``transpose``, ``x + y``, ...)
the records the ATen rules give the function's outputs are a function of what
the rules read: the function, its arguments' values, and each tensor argument's
record, sizes, strides, storage offset, dtype, device, ``requires_grad`` and
which arguments are the same tensor, under the same grad mode. So the first call
with a given *signature* runs as ever, op by op under the dispatch mode, and the
records it gave the outputs are remembered; a later call with the same signature
runs with the dispatch mode off and gets those records set on its outputs.

Only the functions of :func:`replayable` qualify: each computes its outputs from
its inputs by ATen ops that draw nothing, mutate no input and whose decomposition
and output sizes depend only on the signature (no data-dependent shapes). A call
replays only when this forward's dispatch mode is the only one, no saved-tensor
hooks are set (code they run inside an op would run unseen), autocast is off, no
functorch transform is active (its tensors wrap the ones the ops see), nothing is
being compiled, and every tensor argument is a plain ``torch.Tensor`` or
``nn.Parameter`` (an integer tensor of one element is not described: it may
stand for an int, a size or a dimension, whose value the rules read). A first
call is remembered only if the dispatch mode saw no draw and no in-place
restride (``BatchMode.events``), changed no input's record, and set a record on
each of the function's outputs, none of which is an input. The records of the
tensors inside the function (an ``addmm``'s flattened input) are not set by a
replay; nothing outside the function sees those tensors.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from keyinit.nn._batch.records import _DECLARED, Batch, BatchSize, Unknown, record
from keyinit.nn._batch.routed import Routed

__all__ = ["replayable", "signature", "eligible", "replay", "learn", "MAX_SIGNATURES", "REMEMBERED"]

#: Remembered signatures kept (all forgotten when more are learned: a model has a few hundred).
MAX_SIGNATURES = 8192
#: signature -> ``(type of the output, records of its tensors)``: what :func:`learn` remembered, for every
#: keyed forward of the process (a signature holds no tensor, only metadata and records).
REMEMBERED: dict = {}

_TENSOR = object()  # markers of the signature's prefix code (see signature)
_ALIAS = object()
_KWARGS = object()
_SEQUENCES = (tuple, list, torch.Size)
_SCALARS = frozenset({int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device,
                      torch.memory_format, torch.layout})
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Tensor methods (and the operators Python maps to them) that compute new tensors from their inputs:
# no draw, no in-place write, output sizes given by the input sizes and arguments.
_METHODS = (
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "pow", "neg", "abs", "exp", "log",
    "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid", "relu", "clamp", "clip", "maximum",
    "minimum", "reciprocal", "square", "float", "half", "bfloat16", "double", "type_as", "masked_fill", "where",
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "contiguous", "unsqueeze",
    "squeeze", "flatten", "unflatten", "expand_as", "unbind", "chunk", "split", "select", "matmul",
    "bmm", "mm", "softmax", "log_softmax", "sum", "mean", "amax", "amin",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__matmul__", "__rmatmul__", "__neg__", "__pow__", "__rpow__",
    "__getitem__",  # by ints, slices, None and Ellipsis only: a tensor index is not replayed (signature)
)
_TORCH = (
    "add", "sub", "mul", "div", "matmul", "bmm", "mm", "cat", "concat", "concatenate", "stack", "softmax",
    "log_softmax", "rms_norm", "layer_norm", "tanh", "sigmoid", "relu", "exp", "rsqrt", "sqrt", "transpose",
    "permute", "reshape", "flatten", "unsqueeze", "squeeze", "unbind", "chunk", "split", "masked_fill",
)
_FUNCTIONAL = (
    "linear", "gelu", "silu", "relu", "softmax", "log_softmax", "layer_norm", "rms_norm", "mish", "sigmoid",
    "tanh", "softplus", "leaky_relu", "elu", "glu", "hardtanh", "relu6", "hardswish", "hardsigmoid",
)


def replayable() -> frozenset:
    """The torch functions whose output records may be replayed (see the module docstring)."""
    found: set = set()
    F = torch.nn.functional
    for owner, names in ((torch.Tensor, _METHODS), (torch._C.TensorBase, _METHODS), (torch, _TORCH),
                         (F, _FUNCTIONAL)):
        for name in names:
            function = getattr(owner, name, None)
            if function is not None:
                found.add(function)
    return frozenset(found)


def _encode(value: Any, parts: list, tensors: list, records: list, forward: Any) -> bool:
    """Append ``value``'s code to ``parts`` (False: a value a signature cannot describe)."""
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return _encode_tensor(value, kind, parts, tensors, records, forward)
    if kind in _SCALARS:
        parts += (kind, value)
        return True
    if isinstance(value, BatchSize):  # an int to the ATen ops (its tag matters only to factories)
        parts += (int, int.__int__(value))
        return True
    if kind in _SEQUENCES:
        parts += (kind, len(value))
        for item in value:
            if not _encode(item, parts, tensors, records, forward):
                return False
        return True
    if kind is slice:
        parts.append(slice)
        return all(_encode(v, parts, tensors, records, forward) for v in (value.start, value.stop, value.step))
    return False


def _encode_tensor(value: torch.Tensor, kind: type, parts: list, tensors: list, records: list, forward: Any) -> bool:
    if tensors:
        for position, seen in enumerate(tensors):
            if seen is value:
                parts += (_ALIAS, position)
                return True
    dtype = value.dtype
    if dtype.is_floating_point:
        conj = False  # (only a complex tensor has the conjugate bit)
    elif dtype.is_complex:
        conj = value.is_conj()
    elif value.numel() == 1:
        return False  # an integer tensor of one element passes for an int (a size, a dim): its value counts
    else:
        conj = False
    entry = forward.records.get(id(value))  # (record()'s own first look, without its call)
    if entry is not None and entry[0]() is value:
        rec = entry[1]
    elif kind is _Parameter and getattr(value, _DECLARED, None) is None:
        rec = None  # a plain parameter, never declared: replicated (record()'s answer, without its checks)
    else:
        rec = record(value, forward)
    kind_of_record = type(rec)
    if kind_of_record is Batch:
        # a batch as a tuple of ints (hashed and compared in C: a record is a new object at every call, and
        # the attrs methods are Python); anything else as it is (equal by value)
        code: Any = (rec.dim, rec.count, rec.start, rec.inner)
    elif kind_of_record is Routed:
        return False  # rows picked by values: what the rules give depends on the values
    else:
        code = rec
    tensors.append(value)
    records.append(rec)
    parts += (_TENSOR, (kind, code, value.shape, value.stride(), value.storage_offset(), dtype, value.device,
                        value.layout, value.requires_grad, value.is_neg(), conj))
    return True


def signature(func: Any, args: tuple, kwargs: dict, forward: Any) -> Optional[tuple[tuple, list, list]]:
    """``(key, tensors, records)``: what the ATen rules read of a call of ``func`` (a prefix code: every
    value follows its kind), the call's tensors and their records; None when an argument is not a plain
    tensor, a scalar or a sequence of them."""
    parts: list = [func, _grad_enabled(), _inference_mode(), _default_dtype()]
    tensors: list = []
    records: list = []
    for value in args:
        kind = type(value)
        if kind is _Tensor or kind is _Parameter:
            if not _encode_tensor(value, kind, parts, tensors, records, forward):
                return None
        elif kind in _SCALARS:
            parts += (kind, value)
        elif not _encode(value, parts, tensors, records, forward):
            return None
    if kwargs:
        parts.append(_KWARGS)
        for name in sorted(kwargs):
            parts.append(name)
            if not _encode(kwargs[name], parts, tensors, records, forward):
                return None
    if func is _GETITEM and _holds_tensor(args[1:]):
        return None  # a tensor index picks elements by its values (advanced indexing)
    return tuple(parts), tensors, records


_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, slice):
        return _holds_tensor((value.start, value.stop, value.step))
    return False


_GETITEM = torch.Tensor.__getitem__
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_default_dtype = torch.get_default_dtype


def eligible(mode: Any) -> bool:
    """A call may replay or be learned: ``mode`` (this forward's dispatch mode) is the only dispatch mode,
    no saved-tensor hooks are set, autocast is off, no functorch transform (vmap, grad) is active and
    nothing is being compiled."""
    return (_dispatch_modes() == 1 and _dispatch_mode_at(0) is mode and _saved_tensor_hooks(False) is None
            and not _autocast() and not _functorch() and not _compiling())


_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_saved_tensor_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_autocast = torch._C._is_any_autocast_enabled
_functorch = torch._C._are_functorch_transforms_active
_compiling = torch.compiler.is_compiling


def _leaves(out: Any) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def learn(memory: dict, key: tuple, inputs: list, before: list, out: Any, forward: Any) -> None:
    """Remember the records a call run under the dispatch mode gave its outputs (see the module docstring);
    ``before``: its inputs' records when it was called (a call that changed one is not remembered)."""
    if any(record(t, forward) != rec for t, rec in zip(inputs, before)):
        return
    found = []
    records = forward.records
    for leaf in _leaves(out):
        if type(leaf) not in _PLAIN or any(leaf is t for t in inputs):
            return
        entry = records.get(id(leaf))
        if entry is None or entry[0]() is not leaf:
            return  # an output the ATen ops did not make (or did not record): nothing to replay
        if type(entry[1]) is Routed:
            return  # rows picked by values: not a function of the signature
        found.append(entry[1])
    if len(memory) >= MAX_SIGNATURES:
        memory.clear()
    memory[key] = (type(out), tuple(found))


def replay(remembered: tuple, inputs: list, out: Any, forward: Any) -> None:
    """Set the remembered records on the outputs of a call run without the dispatch mode."""
    kind, found = remembered
    records = forward.records
    if type(out) is kind and kind is torch.Tensor and len(found) == 1:  # one output
        for t in inputs:
            if t is out:
                return
        records[id(out)] = (_ref(out), found[0])
        return
    leaves = _leaves(out)
    if type(out) is not kind or len(leaves) != len(found):
        # cannot happen for the same signature; if it did, a draw on these outputs is refused, never guessed
        found = (Unknown("a replayed torch function returned outputs unlike its first call's"),) * len(leaves)
    for leaf, rec in zip(leaves, found):
        if type(leaf) in _PLAIN and not any(leaf is t for t in inputs):
            records[id(leaf)] = (_ref(leaf), rec)


_ref = weakref.ref
