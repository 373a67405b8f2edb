"""``keyinit.deferred``: build a model with its constructor's init code recorded, not run.

Most models initialize in ``__init__`` (torchvision's ResNet loops ``kaiming_normal_``
over its convs, timm calls ``init_weights`` from the constructor, open_clip builds
parameters as ``scale * torch.randn(...)``, HF ends in ``post_init()``). Built on the
meta device that code computes nothing, and nothing is left to replay.

:func:`deferred` calls the builder under a :class:`keyinit._engine.capture.capture.Capture`: every
factory makes a global-shape stand-in (no memory), and every op the constructor
applies to it is recorded in a :mod:`keyinit._engine.programs.program` (the same programs and keying
rules as captured init code). When the builder returns, every parameter and buffer
is replaced by a meta tensor of the same shape, dtype and ``requires_grad`` (ties
kept), and the module keeps the constructor's record of it in ``_keyinit_record``
(:class:`ConstructorRecord`). So ``fully_shard``, ``parallelize_module``, deleting
layers for a pipeline stage, re-parenting and ``model.to(dtype)`` work on the result
as on any meta model, and :func:`keyinit.materialize` replays, for the region each
rank holds, what the constructor did: a draw that fills a whole tensor is keyed by
``key_for(seed, fqn)``, every other draw by ``fold_in`` of the tensor it lands in.

A record belongs to a module and an attribute name, so it follows the module, not
the tensor object: sharding and ``to_empty`` replace the tensor, the record stays.

Nothing here reads or advances the global torch RNG.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar

import attrs
import torch

from keyinit._engine.deferred.megatron_records import whole_node
from keyinit._engine.capture.capture import Capture, LazyTensor
from keyinit._engine.capture.escape import concretize_attributes, escaped_values, forget_escaped, swap_in
from keyinit._engine.programs.guard import ModelState
from keyinit._engine.deferred.lazy import check_lazy
from keyinit._engine.capture.outside import came_from_outside
from keyinit._engine.programs.program import StridedView, Literal, Node, Read, Storage, Write

__all__ = ["deferred", "ConstructorRecord", "record_of", "origin_of", "renumbered_as", "seed_storage", "RECORD_ATTRIBUTE"]

#: The module attribute holding its :class:`ConstructorRecord`.
RECORD_ATTRIBUTE = "_keyinit_record"
#: The attribute of each meta tensor :func:`deferred` returns: the record node of its value
#: (so a tie made after construction, ``model.emb.weight = model.head.weight``, takes the
#: value of the tensor it assigned, as in eager torch).
ORIGIN_ATTRIBUTE = "_keyinit_origin"

M = TypeVar("M", bound=torch.nn.Module)


@attrs.frozen(eq=False)
class ConstructorRecord:
    """What a module's constructor left in each of its parameters and buffers.

    ``values`` maps an attribute name to the node of its value when construction ended
    (a :class:`keyinit._engine.programs.program.Read` of the constructor's buffer, or a
    :class:`keyinit._engine.programs.program.Literal` for a real tensor the builder was given).
    ``builder`` names the builder that ran the constructor (for reports and errors).
    """

    values: Mapping[str, Node]
    builder: str
    #: attribute name -> the tensor's FQN in the model ``builder`` returned (what a renumbered
    #: ``ModuleList`` changes: :func:`renumbered_as`)
    fqns: Mapping[str, str] = attrs.field(factory=dict)

    def value(self, name: str) -> Optional[Node]:
        return self.values.get(name)


def renumbered_as(fqn: str, built: Optional[str]) -> Optional[str]:
    """The FQN ``fqn`` had when it was built, if only a ``ModuleList``/``Sequential`` index of it changed
    since (``del stage.layers[0]``: torch renumbers the rest), else ``None``. ``built`` is its FQN in the
    model :func:`deferred` returned; a model built alone and placed in another keeps its own names
    under a prefix (``layers.3.`` + ``weight``), which is not a renumbering."""
    if built is None or fqn == built or fqn.endswith("." + built):
        return None
    now, then = fqn.split("."), built.split(".")
    if len(then) > len(now):
        return None
    head, tail = now[: len(now) - len(then)], now[len(now) - len(then):]
    if all(a == b or (a.isdigit() and b.isdigit()) for a, b in zip(tail, then)):
        return ".".join(head + then)
    return None


def record_of(module: torch.nn.Module) -> Optional[ConstructorRecord]:
    """The constructor record of ``module`` (``None`` if it was not built by :func:`deferred`)."""
    record = vars(module).get(RECORD_ATTRIBUTE)
    return record if isinstance(record, ConstructorRecord) else None


def origin_of(tensor: torch.Tensor) -> Optional[Node]:
    """The record node of the value :func:`deferred` left in ``tensor`` (``None`` for any other tensor:
    one replaced since, by ``fully_shard`` or ``to_empty``, has none)."""
    return vars(tensor).get(ORIGIN_ATTRIBUTE) if isinstance(tensor, torch.Tensor) else None


def _name_of(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("builtins", "__main__") else str(name)


def deferred(fn: Callable[..., M], /, *args: Any, **kwargs: Any) -> M:
    """Build ``fn(*args, **kwargs)`` on the meta device with its init code recorded for keyed replay.

    ``fn`` is anything that returns an ``nn.Module``: a class, ``timm.create_model``,
    ``torchvision.models.resnet18``, ``AutoModelForCausalLM.from_config``, a lambda. Its
    constructor runs once, on global-shape stand-ins that hold no memory; every op it
    applies to a parameter or buffer (``reset_parameters``, ``kaiming_normal_`` loops,
    ``scale * torch.randn(...)``, ``torch.full(...).triu_(1)``, ``post_init()``) is recorded.

    Returns the model with every parameter and buffer on the meta device. Shard it, cut
    it into pipeline stages, then call :func:`keyinit.materialize` (or, once allocated,
    :func:`keyinit.init_model`): each tensor gets what its constructor gave it, keyed by
    its canonical FQN, for the region each rank holds. Rules win over the record, and an
    ``init_method`` runs on top of it; torch.nn defaults are never applied over it.

    Randomness that cannot be keyed is reported when the model is planned (a rule may
    cover the tensor), as an :class:`keyinit.UnkeyedRandomnessError` naming the module and op.

    Raises:
        TypeError: ``fn`` does not return an ``nn.Module``.
        UnkeyedRandomnessError: the constructor stored a tensor computed from random draws
            in a plain attribute (not a parameter or buffer), where no key can reach it; drew from
            Python's or numpy's global generator (put back); or ran torch ops in threads it started
            (:mod:`keyinit._engine.capture.outside`). On any error the modules ``fn`` was given keep their tensors.
    """
    if not callable(fn):
        raise TypeError(f"keyinit.deferred expects a callable that builds an nn.Module, got {type(fn).__name__}")
    builder = _name_of(fn)
    if Capture.running() is not None:
        # Inside another capture (a factory that returns keyinit.deferred(...), built by
        # `keyinit verify` or an outer deferred): the outer capture records this construction.
        return fn(*args, **kwargs)
    given = ModelState(*_given(args, kwargs))  # what the caller passed (a pretrained backbone), to put back
    capture = Capture()
    try:
        with capture.active(f"{builder}(...)", "constructor"):
            with torch.enable_grad():  # constructors run with grad mode as usual (Parameter flags)
                model = fn(*args, **kwargs)
            _note_real(model)  # real tensors it holds may hold a pool thread's draws (keyinit._engine.capture.outside)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"keyinit.deferred: {builder} returned {type(model).__name__}, not an nn.Module")
        check_lazy(model, f"keyinit.deferred({builder})")
        _finish(model, capture, builder)
    except BaseException:
        capture.put_back()  # values the constructor wrote into the caller's real tensors
        given.restore()  # their modules' tables, tensors' data and requires_grad, hooks, train/eval mode
        forget_escaped(capture)  # no stand-in left in an lru_cache for later eager code
        raise
    return model


def _note_real(model: Any) -> None:
    """Tell the open capture which of ``model``'s tensors were made outside it (real, not stand-ins)."""
    if isinstance(model, torch.nn.Module):
        for fqn, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not isinstance(tensor, LazyTensor) and tensor.device.type != "meta":
                came_from_outside(tensor, fqn)


def _given(args: tuple, kwargs: dict) -> tuple[list[torch.nn.Module], list[tuple[str, torch.Tensor]]]:
    """The modules (with their submodules) and tensors among a builder's arguments (in lists, tuples and
    dicts too), and every tensor they hold."""
    modules: dict[int, torch.nn.Module] = {}
    named: dict[int, tuple[str, torch.Tensor]] = {}
    stack: list[tuple[Any, int]] = [(list(args) + list(kwargs.values()), 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, torch.nn.Module):
            for module in value.modules():
                modules.setdefault(id(module), module)
                for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                    if tensor is not None:
                        named.setdefault(id(tensor), (name, tensor))
        elif isinstance(value, torch.Tensor):
            named.setdefault(id(value), ("argument", value))
        elif isinstance(value, (list, tuple)) and depth < 4:
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, dict) and depth < 4:
            stack.extend((item, depth + 1) for item in value.values())
    return list(modules.values()), list(named.values())


def _finish(model: torch.nn.Module, capture: Capture, builder: str) -> None:
    """Swap every stand-in of ``model`` for a meta tensor and leave each module its record.

    Everything that can fail (a record, a stand-in in a plain attribute that holds a draw) runs
    before any table is touched: when it raises, every module the builder was given (a real
    pretrained backbone) keeps its own tensors. Only the in-place swap of escaped stand-ins runs
    after (torch refuses a tensor a view still holds); :func:`deferred` puts those modules back then."""
    replaced: dict[int, torch.Tensor] = {}
    values: dict[int, Node] = {}
    installs: list[tuple[torch.nn.Module, ConstructorRecord, list[tuple[dict, str, torch.Tensor]]]] = []
    for module_fqn, module in model.named_modules(remove_duplicate=True):
        record: dict[str, Node] = {}
        built: dict[str, str] = {}
        swaps: list[tuple[dict, str, torch.Tensor]] = []
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                fqn = f"{module_fqn}.{name}" if module_fqn else name
                if id(tensor) not in replaced:
                    # megatron-core hook: a tensor-parallel split's record is its WHOLE value (keyinit._engine.deferred.megatron_records)
                    whole = whole_node(module, name, tensor, fqn,
                                                 lambda t, fqn=fqn: _value_node(t, capture, fqn))
                    values[id(tensor)] = whole if whole is not None else _value_node(tensor, capture, fqn)
                    replaced[id(tensor)] = _meta_like(tensor, is_parameter=table is module._parameters)
                    setattr(replaced[id(tensor)], ORIGIN_ATTRIBUTE, values[id(tensor)])
                record[name] = values[id(tensor)]
                built[name] = fqn
                swaps.append((table, name, replaced[id(tensor)]))
        installs.append((module, ConstructorRecord(record, builder, built), swaps))
    # Plain attributes: one that refers to a parameter or buffer (nn.LSTM's _flat_weights)
    # gets its meta replacement; any other stand-in its real value.
    for module_fqn, module in model.named_modules(remove_duplicate=True):
        concretize_attributes(capture, module, module_fqn, replaced, site=f"{builder}(...)")
    # an lru_cache, a hook's closure, a class attribute (a model tensor a cache holds too): their real values
    escaped = escaped_values(capture, replaced, f"{builder}(...)", model)
    tensor = None  # (the last stand-in of the loops above: it would hold a cached table a view of it was taken from)
    for module, record, swaps in installs:
        for table, name, meta in swaps:
            table[name] = meta
        object.__setattr__(module, RECORD_ATTRIBUTE, record)
    # the model holds meta tensors now, and no view of a cached table: in place (a refusal clears the caches,
    # and deferred() puts back the modules it was given)
    swap_in(escaped, f"{builder}(...)")


def _value_node(tensor: torch.Tensor, capture: Capture, fqn: str) -> Node:
    if isinstance(tensor, LazyTensor):
        storage = capture.storage_of(tensor)
        if storage.label == "temporary":
            storage.label = fqn  # errors and reports name the tensor, not "a temporary"
        return Read(storage.current, StridedView.of(tensor._meta), tensor.dtype)
    if tensor.device.type == "meta":  # made on meta outside the capture: nothing to record
        return Read(Storage(tensor.numel(), tensor.dtype, fqn).current, StridedView.contiguous(tensor.shape),
                    tensor.dtype)
    return Literal(tensor.detach().to("cpu").clone())  # a real tensor the builder was given


def _meta_like(tensor: torch.Tensor, *, is_parameter: bool) -> torch.Tensor:
    meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
    if is_parameter:
        meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
    if meta.requires_grad:  # the constructor's gradient hooks (a mask freezing rows) live on in the new tensor
        for hook in (getattr(tensor, "_backward_hooks", None) or {}).values():
            meta.register_hook(hook)
        for hook in (getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values():
            meta.register_post_accumulate_grad_hook(hook)
    for name, value in vars(tensor).items():  # markers (megatron's partition_dim, HF's flags)
        if name.startswith("_") and name not in ("_is_hf_initialized",):
            continue
        try:
            setattr(meta, name, value)
        except (AttributeError, TypeError):
            pass
    return meta


def seed_storage(storage: Storage, node: Node, label: str) -> None:
    """Start a planning buffer (a model tensor's stand-in) from its constructor record ``node``.

    When the record reads a whole contiguous buffer of the same size and dtype, the buffer
    continues the constructor's own writes, so a draw that filled the whole tensor stays its
    own fill (keyed ``key_for(seed, fqn)``, see :func:`keyinit._engine.programs.program.assign_keys`).
    Otherwise the record is written as one value (``label``). ``storage`` has the record's
    dtype: a model cast after construction (``model.to(torch.bfloat16)``) is replayed in the
    constructor's dtype and rounded as it is written, as eager torch casts the built values."""
    if isinstance(node, Read) and node.dtype == storage.dtype and node.geometry == StridedView.contiguous(node.shape):
        root = node.version
        while isinstance(root, Write):
            root = root.prev
        if root.storage.numel == storage.numel and root.storage.dtype == storage.dtype:
            storage.current = node.version
            return
    storage.write(StridedView.contiguous(node.shape), node, label)
