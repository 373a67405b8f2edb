"""The checks of a finished plan: every error planning can show, raised before anything is allocated.

:func:`check_plan` looks at each planned tensor's program: tensors nothing covers (with advice for
this model), tensors init code writes only in part or left uninitialized after its own ``to_empty``,
randomness keyinit cannot key, reads of memory nothing wrote, and every keyinit initializer of a
program run once on an empty region, so dtype, shape and bound errors name their tensor now instead
of part-way through writing. :func:`unused_init_code_note` is the report's note for a meta-built
model whose own init code nothing ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from keyinit import layouts
from keyinit._engine.programs.guard import run_fill
from keyinit._engine.planning.planned import PlannedTensor
from keyinit._engine.programs.program import Random, Read, iter_nodes, root_of, writes_of, written_mask
from keyinit.errors import PlanError, UnkeyedRandomnessError
from keyinit.init import Initializer
from keyinit.keys import Key
from keyinit.regions import make_region

__all__ = ["check_plan", "check_renumbered_keys", "check_scripted", "check_shared_memory", "shared_records_note",
           "unused_init_code_note"]

#: Method names of init code a model may have that nothing runs unless asked (HF, torchtitan, OLMo-core).
_INIT_METHOD_NAMES = ("_init_weights", "init_weights")

#: Buffers up to this many elements get an exact check that init code reads only written elements.
_READ_CHECK_LIMIT = 1 << 24


def check_plan(tensors: Sequence[PlannedTensor], *, materializing: bool, emptied: Mapping[str, str],
               model: torch.nn.Module, init_method: Any, stream: str) -> None:
    """Raise the first problem of the plan (``PlanError`` naming the tensors, or
    ``UnkeyedRandomnessError``). ``materializing``: buffers must be covered too; ``emptied``: tensors
    init code's own ``to_empty`` left uninitialized, to the call that did it."""
    missing = [t.fqn for t in tensors if t.program is None and (materializing or t.kind == "parameter")
               and math.prod(t.global_shape) > 0]  # a tensor of no elements has nothing to initialize
    left_empty = [fqn for fqn in missing if fqn in emptied]
    if left_empty:
        raise PlanError(
            f"{emptied[left_empty[0]]}: init code's to_empty left these tensors uninitialized and nothing "
            "wrote them afterwards (eager torch would leave uninitialized memory there): " + ", ".join(left_empty)
            + ". Initialize them in the init code after to_empty, or give them a rule.", tuple(left_empty))
    if missing:
        raise PlanError(
            "no rule or init method covers these tensors: " + ", ".join(missing) + ". "
            + _missing_advice(model, tensors, init_method), tuple(missing)
        )
    _check_added_after_construction(model, tensors, init_method)
    partial = [t.fqn for t in tensors if t.program is not None and not t.program.complete]
    if partial and materializing:
        raise PlanError("init code writes only part of these tensors (the rest would be uninitialized memory): "
                        + ", ".join(partial), tuple(partial))
    for t in tensors:
        if t.program is None:
            continue
        for node in iter_nodes(t.program.roots()):
            if isinstance(node, Random) and node.unkeyable is not None:
                raise UnkeyedRandomnessError(f"{node.site}: {node.unkeyable} (it feeds {t.fqn})")
            if isinstance(node, Read) and not _reads_written(node):
                raise PlanError(f"init code reads elements of {_buffer_label(node)} that nothing wrote "
                                f"(uninitialized memory) to compute {t.fqn}", (t.fqn,))
    for t in tensors:
        if t.program is not None:
            _dry_run(t, stream)


def _check_added_after_construction(model: torch.nn.Module, tensors: Sequence[PlannedTensor], init_method: Any) -> None:
    """A model built by ``keyinit.deferred`` with HF's ``_init_weights`` on its root, where modules added or
    replaced afterwards (HF's ``resize_token_embeddings`` on the meta model, which runs ``_init_weights`` on
    them: nothing on meta) would get torch.nn's defaults (N(0, 1) embeddings) instead: a :class:`PlanError`
    naming them."""
    from keyinit._engine.deferred.deferred import record_of

    if init_method is not None or not any(record_of(m) is not None for m in model.modules()):
        return
    # HF's _init_weights on the root: HF's own code (resize_token_embeddings) runs it on the modules it adds, where
    # eager torch gives them that init; a head a user assigns (timm's init_weights models) gets torch.nn's defaults
    own = [f"{type(model).__name__}._init_weights"] if callable(getattr(model, "_init_weights", None)) else []
    def built(module: torch.nn.Module, attr: str, t: PlannedTensor) -> bool:  # its constructor made it this shape
        node = record_of(module).value(attr) if record_of(module) is not None else None
        return node is not None and tuple(node.shape) == tuple(t.global_shape)

    added = [t.fqn for t in tensors if t.origin == "default" and not any(built(m, a, t) for m, a in t.locations())]
    if own and added:
        raise PlanError(
            f"these tensors were added or replaced after keyinit.deferred built the model (HF's "
            f"resize_token_embeddings on the meta model does this) and would get torch.nn's defaults, not the "
            f"model's own init ({', '.join(own)}): {', '.join(added)}. Make the change inside the builder "
            f"(keyinit.deferred(lambda: resized(Model(config)))), so it is recorded, or give them a rule "
            f"(rules={{'{added[0]}': keyinit.init.normal(std=0.02)}})", tuple(added))


def check_scripted(tensors: Sequence[PlannedTensor]) -> None:
    """Tensors held by a ``torch.jit.script`` module are a :class:`PlanError` naming them: its parameter
    and buffer tables are C++ objects keyinit cannot swap stand-ins into or put back. A scripted module
    without tensors (an activation) is fine."""
    scripted = [t.fqn for t in tensors if any(isinstance(m, torch.jit.ScriptModule) for m, _ in t.locations())]
    if scripted:
        raise PlanError(f"these tensors belong to a torch.jit.script module, whose tables keyinit cannot swap or "
                        f"restore: {', '.join(scripted)}; initialize the model first and script the module "
                        f"afterwards (torch.jit.script(model.sub) after init_model / materialize)", tuple(scripted))


def check_shared_memory(tensors: Sequence[PlannedTensor]) -> None:
    """Two different tensors of the model whose elements share memory (``a = Parameter(base)``,
    ``b = Parameter(base[:2])``) are a :class:`PlanError` naming both: each is written with its own
    key, so on a plain model one's values land in the other's elements, while a sharded layout keeps
    them apart; the layouts would disagree. One tensor under two names (a tie) is not this, nor are
    views of one buffer that share no element (an LSTM's flattened weights)."""
    spans: list[tuple[int, int, int, str, torch.Tensor]] = []
    for t in tensors:
        if t.new:
            continue
        for module, attr in t.locations():
            tensor = getattr(module, attr, None)
            local = getattr(tensor, "_local_tensor", tensor)
            if not isinstance(local, torch.Tensor) or local.device.type == "meta" or local.numel() == 0 \
                    or local.layout != torch.strided:
                continue
            size = local.element_size()
            start = local.storage_offset() * size
            end = start + (1 + sum((n - 1) * s for n, s in zip(local.shape, local.stride()))) * size
            spans.append((local.untyped_storage().data_ptr(), start, end, t.fqn, local))
    by_storage: dict[int, list[tuple[int, int, str, torch.Tensor]]] = {}
    for ptr, start, end, fqn, local in spans:
        by_storage.setdefault(ptr, []).append((start, end, fqn, local))
    for group in by_storage.values():
        for i, (start, end, fqn, local) in enumerate(group):
            for start2, end2, fqn2, local2 in group[i + 1:]:
                if fqn != fqn2 and start < end2 and start2 < end and _elements_meet(local, local2):
                    _refuse_shared(fqn, fqn2)


def _refuse_shared(fqn: str, fqn2: str) -> None:
    raise PlanError(
        f"{fqn} and {fqn2} are different tensors sharing memory (views of one storage): keyinit writes each "
        f"with its own key, so on a plain model one's values would land in the other's elements while a "
        f"sharded layout keeps them apart. Give each its own storage (.clone()) or make them one tensor (a "
        f"tie: the same Parameter under both names)", (fqn, fqn2))


def _elements_meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided views of one storage share a byte (exact up to a size limit, else assumed)."""
    if a.numel() + b.numel() > _READ_CHECK_LIMIT:
        return True

    def offsets(t: torch.Tensor) -> torch.Tensor:
        at = torch.full((), t.storage_offset() * t.element_size(), dtype=torch.int64)
        for n, s in zip(t.shape, t.stride()):
            at = at.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (s * t.element_size())
        at = at.reshape(-1, 1) + torch.arange(t.element_size(), dtype=torch.int64)
        return at.reshape(-1)

    return bool(torch.isin(offsets(a), offsets(b)).any())


def unused_init_code_note(model: torch.nn.Module, tensors: Sequence[PlannedTensor], init_method: Any) -> Optional[str]:
    """A model built without ``deferred`` whose tensors got torch.nn's defaults, while it has init
    code of its own that nothing ran (``self.apply(self._init_weights)`` in ``__init__`` on meta):
    the note naming the method and what to do, else None."""
    if init_method is not None or any(t.record is not None for t in tensors):
        return None
    defaults = [t.fqn for t in tensors if t.origin == "default"]
    if not defaults:
        return None
    methods = sorted({f"{type(module).__name__}.{name}" for module in model.modules()
                      for name in _INIT_METHOD_NAMES if callable(getattr(module, name, None))})
    if not methods:
        return None
    return (f"{len(defaults)} tensors got torch.nn's defaults ({', '.join(defaults[:3])}"
            f"{', ...' if len(defaults) > 3 else ''}), but the model has init code that did not run: "
            f"{', '.join(methods)}. If its constructor calls it, build the model with "
            f"keyinit.deferred(ModelClass, ...) (its own init is then replayed, keyed); otherwise pass "
            f"init_method= (docs/init-code.md#which-init-does-my-model-get)")


def _missing_advice(model: torch.nn.Module, tensors: Sequence[PlannedTensor], init_method: Any) -> str:
    """What to do about tensors nothing covers, for this model."""
    advice = []
    if not any(t.record is not None for t in tensors):
        advice.append("If the model's constructor initializes them (most models do: torchvision, timm, HF "
                      "post_init, megatron), build it with keyinit.deferred(ModelClass, ...) instead of on "
                      "meta and its own init is replayed, keyed (docs/init-code.md)")
    own = getattr(model, "_init_weights", None)
    if init_method is None and callable(own):
        advice.append("this model has _init_weights: pass init_method=model._init_weights")
    advice.append("or register a rule (@keyinit.register(ModuleType) or rules={'fqn glob': initializer}), "
                  "give the module reset_parameters(), or pass init_method=")
    return "; ".join(advice) + "."


def _dry_run(t: PlannedTensor, stream: str) -> None:
    """Run every :class:`Initializer` of the program on an empty region: dtype, shape and bound
    errors surface now, naming the tensor, instead of part-way through writing; so does a draw
    from torch's RNG in an Initializer of the user's own (:func:`keyinit._engine.programs.guard.run_fill`)."""
    for node in iter_nodes(t.program.roots()):
        if not isinstance(node, Random) or node.by_index or not isinstance(node.fill, Initializer):
            continue  # a plain fn(key, target) may keep state: it runs once, when writing
        shape = node.shape
        if shape and math.prod(shape) > 0:
            region = make_region(shape, (slice(0, 0),) + tuple(slice(None) for _ in shape[1:]))
        else:
            region = make_region(shape, None)
        out = torch.empty(region.region_shape, dtype=node.dtype, device="cpu")
        try:
            run_fill(node.fill, Key(0, 0, stream), layouts.Target(t.fqn, region, out))
        except UnkeyedRandomnessError:
            raise
        except Exception as exc:  # any error of a dry run is a plan error naming the tensor
            message = str(exc) if t.fqn in str(exc) else f"{t.fqn}: {type(exc).__name__}: {exc}"
            raise PlanError(f"{message} (planned by {node.what})", (t.fqn,)) from exc


def _reads_written(read: Read) -> bool:
    """Whether every element a read sees was written before it (exact for buffers up to the limit)."""
    chain = writes_of(read.version)
    numel = root_of(read.version).storage.numel
    if any(write.geometry.covers_buffer(numel) for write in chain):
        return True
    if numel > _READ_CHECK_LIMIT:
        return True  # replay still raises if an unwritten element is read
    written = written_mask(chain, numel)
    g = read.geometry
    return bool(written.as_strided(g.size, g.stride, g.offset).all())


def _buffer_label(read: Read) -> str:
    label = root_of(read.version).storage.label
    return "a temporary tensor" if label == "temporary" else label


def check_renumbered_keys(tensors: Sequence[PlannedTensor], renumbered: Sequence[PlannedTensor]) -> None:
    """No two different tensors keyed alike because one was renumbered (``del layers[0]`` and then a
    new layer appended where the last one was built): they would get the same random values."""
    moved = {id(t) for t in renumbered}
    by_key: dict[str, list[PlannedTensor]] = {}
    for t in tensors:
        by_key.setdefault(t.key_fqn, []).append(t)
    clashes = [group for group in by_key.values() if len(group) > 1 and any(id(t) in moved for t in group)]
    if clashes:
        described = "; ".join(" and ".join(f"{t.fqn}{' (renumbered)' if id(t) in moved else ''}" for t in group)
                              + f" would all be keyed as {group[0].key_fqn}" for group in clashes)
        raise PlanError(f"{described}: different tensors keyed by the same name get the same random values. "
                        f"A ModuleList entry renumbered after construction is keyed by the name "
                        f"it was built with; name every tensor's full-model FQN with fqn_map (which turns the "
                        f"renumbering off), or build the stage's new modules inside the builder",
                        tuple(t.fqn for group in clashes for t in group))


def shared_records_note(tensors: Sequence[PlannedTensor]) -> Optional[str]:
    """The report's note for different tensors a constructor built as views sharing elements of one buffer
    (``a = Parameter(base)``, ``b = Parameter(base[:2])``): each gets its own memory holding the
    constructor's values, on every layout alike, as torch's ``to_empty`` and FSDP2 give them."""
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for t in tensors:
        if isinstance(t.record, Read):
            g = t.record.geometry
            end = g.offset + 1 + sum((n - 1) * s for n, s in zip(g.size, g.stride)) if all(g.size) else g.offset
            spans.setdefault(id(root_of(t.record.version).storage), []).append((g.offset, end, t.fqn))
    pairs = [f"{a} and {b}" for group in spans.values() for i, (s1, e1, a) in enumerate(group)
             for s2, e2, b in group[i + 1:] if s1 < e2 and s2 < e1]
    if not pairs:
        return None
    return (f"{'; '.join(pairs[:4])}{' ...' if len(pairs) > 4 else ''} shared memory when the constructor built them; "
            f"each gets its own, holding the constructor's values on every layout (as torch's to_empty and FSDP2 "
            f"give them): tie or view them again after materialize if they must share")
