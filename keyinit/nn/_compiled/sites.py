"""The random sites of a compiled keyed forward: two custom ops whose keys and offset are tensor inputs.

A keyed forward compiled by :func:`keyinit.nn.compile` is traced once (per input
shapes and batch records) by running it under keyed()'s own modes
(:mod:`keyinit.nn._compiled.compile`). Where the eager forward would draw, the trace
records a *site* instead: a call of one of the ops below, whose non-tensor
arguments (the op, ``p``, the batch record, which key) are a JSON ``spec``
string, and whose key words and sample offset are read at run time from
``ctl``, an int64 tensor the compiled graph takes as an input::

    ctl = [start, k0(slot 0), k1(slot 0), k0(slot 1), k1(slot 1), ...]

``start`` is the running forward's first global sample; a record's samples are
``start + delta`` onwards. So a new step, seed or sample offset is a new ``ctl``,
never a new graph. Each op computes its values by calling the very function
the eager keyed forward calls (:func:`keyinit.nn._forward.intercept.keyed_masked`,
:func:`keyinit.nn.functional.probs_drop`, :func:`keyinit.nn._forward.draws.keyed_draw`)
with the key and batch rebuilt from ``ctl`` and ``spec``: a compiled keyed
forward draws exactly what the eager one draws.

- ``keyinit::keyed_dropout(Tensor input, Tensor ctl, str spec) -> Tensor``: the
  dropout family and attention dropout. Element-wise and channel-wise dropout
  are diagonal and linear, so the backward is the same op on the gradient (the
  mask regenerated from the key); the alpha forms' backward is ``a * keep * grad``.
- ``keyinit::keyed_values(Tensor ctl, Tensor[] tensors, str spec) -> Tensor[]``:
  any other random ATen op (``rand``, ``bernoulli_``, ``normal_``, ...); its
  outputs hold no gradient. An in-place op's site returns the new values of
  the tensors it writes, and the trace copies them in.

The spec is self-describing (no process-wide table), so a graph cached by
torch.compile and loaded in another process still means the same draws.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional

import attrs
import torch

from keyinit.keys import Key
from keyinit.nn._batch.propagate import propagate_traced
from keyinit.nn._batch.routed import needs_values
from keyinit.nn._forward.drawer import Drawer

__all__ = ["Trace", "SlotKey", "keyed_dropout", "keyed_values"]


@attrs.frozen
class SlotKey:
    """A key read at run time: words ``ctl[1 + 2 * slot]``, ``ctl[2 + 2 * slot]`` of the graph's control tensor."""

    slot: int
    stream: str


# ----------------------------------------------------------------------------- specs


def _encode(value: Any, tensors: list) -> Any:
    """A JSON form of an ATen op's argument; tensors go to ``tensors`` and are referenced by position."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # a BatchSize is an int
    if isinstance(value, float):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).replace("torch.", "")}
    if isinstance(value, torch.Generator):
        return None  # never read: the values are keyinit's
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode(v, tensors) for v in value]}
    raise TypeError(f"keyinit.nn.compile: cannot record the argument {value!r} ({type(value).__name__}) of a random op")


def _decode(value: Any, tensors: list) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "t":
        return tensors[inner]
    if kind in ("dtype", "layout", "memory_format"):
        return getattr(torch, inner)
    if kind == "device":
        return torch.device(inner)
    items = [_decode(v, tensors) for v in inner]
    return items if kind == "list" else tuple(items)


@functools.lru_cache(maxsize=4096)
def _spec(text: str) -> dict:
    return json.loads(text)


def _op(name: str) -> Any:
    namespace, _, rest = name.partition("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _key(ctl: list, ref: Any, stream: str) -> Key:
    if isinstance(ref, list):  # a key fixed at trace time (a draw of p = 0, which takes no ordinal)
        return Key(ref[0], ref[1], stream)
    return Key(ctl[1 + 2 * ref], ctl[2 + 2 * ref], stream)


def _batch(ctl: list, rec: Optional[list]) -> Any:
    from keyinit.nn._batch.records import Batch

    if rec is None:
        return None
    dim, count, delta, inner = rec
    return Batch(dim, count, ctl[0] + delta, inner)


def _words(ctl: torch.Tensor) -> list:
    return ctl.tolist()


# ----------------------------------------------------------------------------- the ops


def _dropout_impl(input: torch.Tensor, words: list, spec: dict) -> torch.Tensor:
    from keyinit.nn._forward.intercept import alpha_scale, keyed_masked, masked_keep
    from keyinit.nn import functional as KF

    key = _key(words, spec["key"], spec["stream"])
    if spec["kind"] == "rows":  # attention probabilities whose row 0 is sample start + delta
        return KF.probs_drop(spec["p"], key, None, words[0] + spec["delta"])(input)
    rec = _batch(words, spec["rec"])
    if spec.get("grad"):  # the alpha forms' backward: a * keep * grad
        keep, grad, _ = masked_keep(spec["kind"], spec["mask"], input, spec["p"], key, rec)
        scaled = grad * alpha_scale(spec["p"]) if spec["p"] < 1.0 else grad * 0
        return torch.where(keep, scaled, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return keyed_masked(spec["kind"], spec["mask"], input, spec["p"], key, rec)


@torch.library.custom_op("keyinit::keyed_dropout", mutates_args=())
def keyed_dropout(input: torch.Tensor, ctl: torch.Tensor, spec: str) -> torch.Tensor:
    """A dropout site of a compiled keyed forward (see the module docstring)."""
    return _dropout_impl(input, _words(ctl), _spec(spec)).contiguous()


@keyed_dropout.register_fake
def _(input: torch.Tensor, ctl: torch.Tensor, spec: str) -> torch.Tensor:
    return torch.empty(input.shape, dtype=input.dtype, device=input.device)


def _dropout_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    _, ctl, spec = inputs
    ctx.save_for_backward(ctl)
    ctx.spec = spec


def _dropout_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (ctl,) = ctx.saved_tensors
    spec = _spec(ctx.spec)
    if spec.get("mask") in ("alpha", "feature_alpha"):
        spec = dict(spec, grad=True)
        return keyed_dropout(grad, ctl, json.dumps(spec, sort_keys=True)), None, None
    return keyed_dropout(grad, ctl, ctx.spec), None, None


keyed_dropout.register_autograd(_dropout_backward, setup_context=_dropout_setup)


def _values_impl(words: list, tensors: list, spec: dict) -> list:
    from keyinit.nn._forward.draws import keyed_draw

    func = _op(spec["op"])
    tensors = list(tensors)
    written = spec["written"]
    for i in written:  # an in-place op writes a copy: the site returns the new values
        tensors[i] = tensors[i].clone()
    args = [_decode(value, tensors) for value in spec["args"]]
    kwargs = {name: _decode(value, tensors) for name, value in spec["kwargs"].items()}
    out = keyed_draw(func, tuple(args), dict(kwargs), _key(words, spec["key"], spec["stream"]),
                     _batch(words, spec["rec"]), spec["site"])
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if written:
        # the new values of the tensors it writes, then the outputs that alias none of them (rrelu_with_noise
        # writes its noise and returns a new tensor; an in-place op such as bernoulli_ returns only its self)
        return [tensors[i] for i in written] + _fresh(func, outs)
    return outs


def _fresh(func: Any, outs: list) -> list:
    """The outputs of ``func`` that are new tensors (their schema return aliases no argument)."""
    return [o for o, ret in zip(outs, func._schema.returns) if ret.alias_info is None]


@torch.library.custom_op("keyinit::keyed_values", mutates_args=())
def keyed_values(ctl: torch.Tensor, tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """A random-op site of a compiled keyed forward (see the module docstring)."""
    return [t.clone() if any(t is s for s in tensors) else t for t in _values_impl(_words(ctl), tensors, _spec(spec))]


@keyed_values.register_fake
def _(ctl: torch.Tensor, tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
            for shape, stride, dtype, device in _spec(spec)["out"]]


def _values_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.count = len(inputs[1])
    for out in output:
        ctx.mark_non_differentiable(out)


def _values_backward(ctx: Any, *grads: Any) -> tuple:
    # random values carry no gradient to the tensors they were drawn from (probabilities, shapes)
    return None, [None] * ctx.count, None


keyed_values.register_autograd(_values_backward, setup_context=_values_setup)


# ----------------------------------------------------------------------------- the trace


class Trace(Drawer):
    """The sites of one graph being traced, and its control tensor: the drawer of its trace
    (:mod:`keyinit.nn._forward.drawer`), each draw a site op.

    ``start`` is the traced forward's first global sample. ``key_of(fqn, ordinal)`` gives
    the real key of a call (the trace runs for real); each slot is remembered as
    ``(fqn relative to the compiled module, ordinal)`` for the run-time keys.
    """

    def __init__(self, start: int, stream: str, key_of: Callable[[str, int], Key], capacity: int) -> None:
        self.start = start
        self.stream = stream
        self.key_of = key_of
        self.slots: list[tuple[str, int]] = []
        self.ctl = torch.zeros(1 + 2 * capacity, dtype=torch.int64)
        self._words = self.ctl.numpy()  # written outside the trace: the graph sees only the input
        self._words[0] = start
        self.capacity = capacity

    def slot(self, fqn: str, ordinal: int) -> SlotKey:
        if len(self.slots) == self.capacity:
            raise OverflowError(f"more than {self.capacity} random sites")  # the caller retraces, larger
        k = self.key_of(fqn, ordinal)
        i = len(self.slots)
        self.slots.append((fqn, ordinal))
        self._words[1 + 2 * i], self._words[2 + 2 * i] = k.k0, k.k1
        return SlotKey(i, k.stream)

    def _key_ref(self, key: Any) -> Any:
        if isinstance(key, SlotKey):
            return key.slot
        if key.stream != self.stream:
            raise ValueError(f"a fixed key of stream {key.stream!r} in a trace of stream {self.stream!r}")
        return [key.k0, key.k1]

    def _rec(self, rec: Any) -> Optional[list]:
        if rec is None:
            return None
        return [rec.dim, rec.count, rec.start - self.start, rec.inner]

    def _spec(self, **fields: Any) -> str:
        return json.dumps(dict(fields, stream=self.stream), sort_keys=True)

    def masked(self, kind: str, mask: str, input: torch.Tensor, p: float, key: Any, rec: Any) -> torch.Tensor:
        """A dropout-family site (what :func:`keyinit.nn._forward.intercept.keyed_masked` computes)."""
        from keyinit.nn import functional as KF

        if KF.is_dtensor(input):
            raise TypeError("keyinit.nn.compile: dropout of a DTensor activation is not supported in a compiled keyed "
                            "forward; run it eagerly under keyinit.nn.keyed")
        spec = self._spec(kind=kind, mask=mask, p=p, key=self._key_ref(key), rec=self._rec(rec))
        return keyed_dropout(input, self.ctl, spec)

    def rows_drop(self, p: float, key: Any, start: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Attention dropout of probabilities whose row 0 is sample ``start``."""
        from keyinit.nn import functional as KF

        spec = self._spec(kind="rows", p=p, key=self._key_ref(key), delta=start - self.start)

        def drop(probs: torch.Tensor) -> torch.Tensor:
            if KF.is_dtensor(probs):
                raise TypeError("keyinit.nn.compile: attention dropout of DTensor activations is not supported in a "
                                "compiled keyed forward; run it eagerly under keyinit.nn.keyed")
            return keyed_dropout(probs, self.ctl, spec)

        return drop

    eager = False  # (no fast path: every draw goes to a site)

    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any, records: list) -> list:
        """The batch records of an op's outputs, from its metadata only: the graph is replayed for any values
        (:func:`keyinit.nn._batch.propagate.propagate_traced`)."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return propagate_traced(func, args, kwargs, out, records)

    def on_values(self, frame: Any, what: str) -> None:
        """A draw on rows picked by values: refused, with the error that makes :mod:`keyinit.nn._compiled.compile`
        run the graph eagerly under keyed()'s modes."""
        raise needs_values(f"{frame.describe()}: {what}")

    def values(self, func: Any, args: tuple, kwargs: dict, key: Any, batch: Any, site: str) -> Any:
        """A random ATen op's site (what :func:`keyinit.nn._forward.draws.keyed_draw` computes)."""
        from torch.utils._python_dispatch import _disable_current_modes

        tensors: list = []
        encoded_args = _encode(list(args), tensors)
        encoded_kwargs = {name: _encode(value, tensors) for name, value in kwargs.items()}
        written = [i for i, t in enumerate(tensors) if _writes(func, args, kwargs, t)]
        fields = dict(op=func.name(), args=encoded_args["list"], kwargs=encoded_kwargs, key=self._key_ref(key),
                      rec=self._rec(batch), site=site, written=written)
        words = self.ctl.tolist()
        with _disable_current_modes():  # the values once, outside the trace: their shapes for the fake kernel
            outs = _values_impl(words, [t.detach() for t in tensors], dict(fields, stream=self.stream))
        fields["out"] = [(list(o.shape), list(o.stride()), str(o.dtype).replace("torch.", ""), str(o.device))
                         for o in outs]
        results = keyed_values(self.ctl, tensors, self._spec(**fields))
        if written:
            for i, new in zip(written, results):
                tensors[i].copy_(new)
            # the op's returns in its schema's order: a return that aliases a written argument is that argument
            # (bernoulli_'s self), any other is one of the site's further results (rrelu_with_noise's output)
            fresh = iter(results[len(written):])
            outputs = []
            for ret in func._schema.returns:
                info = ret.alias_info
                if info is None:
                    outputs.append(next(fresh))
                    continue
                outputs.append(next(tensors[i] for i in written
                                    if _alias_set(func, args, kwargs, tensors[i]) == set(info.before_set)))
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        return results[0] if len(results) == 1 else tuple(results)


def _alias_set(func: Any, args: tuple, kwargs: dict, tensor: torch.Tensor) -> set:
    """The alias set of the argument of ``func`` that ``tensor`` is (empty: none)."""
    for position, argument in enumerate(func._schema.arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if value is tensor and argument.alias_info is not None:
            return set(argument.alias_info.before_set)
    return set()


def _writes(func: Any, args: tuple, kwargs: dict, tensor: torch.Tensor) -> bool:
    """``tensor`` is an argument ``func`` writes (``self`` of an in-place op, an ``out=``)."""
    for position, argument in enumerate(func._schema.arguments):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if value is tensor:
            return True
    return False
