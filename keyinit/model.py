"""The model walker: ``init_model`` and ``materialize``.

``init_model(model, seed)`` gives every parameter (and every buffer a rule or
init code covers) the values

    value[i] = program(key_for(seed, canonical_fqn))[i]

for each global element ``i`` this process holds, so any layout reproduces the
single-process values bit for bit, with no communication.

It works in two phases. *Plan* (:mod:`keyinit._engine.plan`): find every tensor, its
canonical FQN, ties and global shape; resolve rules; capture the model's own
init code on global-shape stand-ins; fail with a list of FQNs if anything is
uncovered, unkeyable or cannot be filled. Nothing is allocated or written
while planning. *Write*: replay each tensor's program for the region this
process holds (:mod:`keyinit._engine.replay`), lowest precedence first (built-in
defaults, init code, module rules, FQN patterns), so a failure part-way leaves
an exact record of what was written.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional, Union

import attrs
import torch

from keyinit.errors import InitError, PlanError
from keyinit.fqn import FqnMap
from keyinit.init import Initializer
from keyinit._engine.program import Const, Random, iter_nodes
from keyinit.keys import DEFAULT_STREAM, Key
from keyinit._engine.options import InitMethod, InitOptions, Rules
from keyinit._engine.plan import plan_model
from keyinit._engine.planned import ModelPlan, PlannedTensor
from keyinit.rules import REGISTRY, Registry

__all__ = ["init_model", "materialize", "plan_init", "Plan", "PlanEntry", "InitReport", "TensorRecord", "InitError", "PlanError"]

logger = logging.getLogger("keyinit")


@attrs.frozen
class TensorRecord:
    """One line of the report: how a tensor was initialized."""

    fqn: str
    key_fqn: str
    kind: str  # "parameter" or "buffer"
    source: str  # which rule wrote it last, or "kept"
    global_numel: int
    local_numel: int
    layout: str
    element_local: bool = True


@attrs.frozen
class InitReport:
    """What ``init_model`` did. ``str(report)`` is a table."""

    seed: int
    stream: str
    records: tuple[TensorRecord, ...]
    seconds: float
    notes: tuple[str, ...] = ()  # e.g. init code that failed where rules cover everything it writes

    @property
    def parameters(self) -> int:
        return sum(r.kind == "parameter" and r.source != "kept" for r in self.records)

    @property
    def elements(self) -> int:
        """Global elements of the initialized tensors."""
        return sum(r.global_numel for r in self.records if r.source != "kept")

    @property
    def local_elements(self) -> int:
        """Elements this process generated."""
        return sum(r.local_numel for r in self.records if r.source != "kept")

    @property
    def non_local(self) -> tuple[str, ...]:
        """Tensors whose values are computed whole on every process (orthogonal, reductions in init code)."""
        return tuple(r.fqn for r in self.records if not r.element_local)

    @property
    def defaults(self) -> tuple[str, ...]:
        """Tensors that got torch.nn's default initialization (``default Linear``, ...), not the
        model's own init code: build the model with :func:`keyinit.deferred` to record its
        constructor's init, or pass ``init_method=``."""
        return tuple(r.fqn for r in self.records if r.source.startswith("default "))

    def by_source(self) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for r in self.records:
            grouped.setdefault(r.source, []).append(r.fqn)
        return grouped

    def __str__(self) -> str:
        width = max([len(r.fqn) for r in self.records] + [3])
        source_width = max([len(r.source) for r in self.records] + [6])
        lines = [
            f"keyinit: seed={self.seed} stream={self.stream} tensors={len(self.records)} "
            f"parameters={self.parameters} elements={self.elements} local={self.local_elements} "
            f"time={self.seconds:.3f}s",
            f"{'fqn':<{width}}  {'source':<{source_width}} {'local/global':>21}  layout",
        ]
        for r in self.records:
            flag = "  [draws full tensor on every rank]" if not r.element_local else ""
            tied = f" (key of {r.key_fqn})" if r.key_fqn != r.fqn else ""
            lines.append(
                f"{r.fqn:<{width}}  {r.source:<{source_width}} {r.local_numel:>10}/{r.global_numel:<10}  {r.layout}{tied}{flag}"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


class _Writer:
    """Writes every planned tensor into its target (this process's region), lowest precedence first."""

    def __init__(self, plan: ModelPlan, progress: Optional[bool], device: Union[torch.device, str, None] = None) -> None:
        self.plan = plan
        self.device = device
        self.written: list[PlannedTensor] = []
        self.partial: Optional[str] = None  # a tensor a failed write may have left partly written
        self.layouts: dict[int, tuple[str, int]] = {}
        self._total = sum(math.prod(t.global_shape) for t in plan.tensors if t.program is not None)
        self._done = 0
        self._started = time.perf_counter()
        self._last_tick = 0.0
        self._show_progress = progress if progress is not None else self._total >= 1 << 28

    def order(self) -> list[PlannedTensor]:
        rank = {name: i for i, name in enumerate(("constructor", "default", "code", "rule", "pattern"))}
        todo = [t for t in self.plan.tensors if t.program is not None]
        return sorted(todo, key=lambda t: rank.get(t.origin, 0))  # stable: model order within a class

    def run(self) -> None:
        try:
            with torch.no_grad():
                for tensor in self.order():
                    self._write(tensor)
        except Exception as exc:
            written = tuple(t.fqn for t in self.written)
            raise InitError(
                f"initialization failed part-way ({type(exc).__name__}: {exc}); these tensors were already "
                f"written: {list(written) or 'none'}; "
                + (f"{self.partial} may be partly written; " if self.partial else "")
                + "every other tensor is unchanged",
                written,
            ) from exc
        finally:
            self._finish_progress()

    def _write(self, tensor: PlannedTensor) -> None:
        undo = _Undo(tensor, self.plan, keep_values=self.device is None and _may_fail_part_way(tensor))
        try:
            self._write_unguarded(tensor)
        except BaseException:
            undo()  # the failing tensor is put back as it was: InitError.written stays exact
            if undo.saved is None and self.device is None and not (tensor.new or tensor.recreated):
                self.partial = tensor.fqn  # a keyinit initializer stopped by an interrupt or out of memory
            raise

    def _write_unguarded(self, tensor: PlannedTensor) -> None:
        if tensor.new:
            self._create(tensor)
        elif tensor.recreated:
            self._recreate(tensor)
        target = self.plan.target(tensor)
        self.plan.write(tensor, target)
        for module, attr in tensor.distinct_alias_tensors():
            self.plan.write(tensor, self.plan.target(tensor, module, attr))
        local = self.plan.element_local(tensor)
        self.layouts[id(tensor)] = (target.description, target.out.numel() if local else math.prod(target.global_shape))
        self.written.append(tensor)
        self._tick(tensor)

    @staticmethod
    def _recreate(tensor: PlannedTensor) -> None:
        """Init code assigned a buffer of a new shape or dtype: give the module a plain tensor of it."""
        old = tensor.tensor
        local = getattr(old, "_local_tensor", old)
        fresh = torch.empty(tensor.global_shape, dtype=tensor.dtype, device=local.device)
        for module, attr in tensor.locations():
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(fresh, requires_grad=old.requires_grad)
            else:
                module._buffers[attr] = fresh

    def _create(self, tensor: PlannedTensor) -> None:
        """A tensor init code created where there was none: a plain tensor on the module's device."""
        module = tensor.module
        device = self.device
        if device is None:
            existing = next(iter([*module.parameters(), *module.buffers()]), None)
            local = getattr(existing, "_local_tensor", existing)
            device = local.device if local is not None else "cpu"
        fresh = torch.empty(tensor.global_shape, dtype=tensor.dtype, device=device)
        if tensor.kind == "parameter":
            module.register_parameter(tensor.attr, torch.nn.Parameter(fresh))
        elif tensor.kind.startswith("buffer"):
            module.register_buffer(tensor.attr, fresh, persistent=tensor.kind == "buffer")
        else:
            setattr(module, tensor.attr, fresh)

    def _tick(self, tensor: PlannedTensor) -> None:
        self._done += math.prod(tensor.global_shape)
        if not self._show_progress:
            return
        now = time.perf_counter()
        if now - self._last_tick < 0.5 and self._done < self._total:
            return
        self._last_tick = now
        fraction = self._done / max(self._total, 1)
        if sys.stderr.isatty():
            bar = "#" * int(30 * fraction)
            sys.stderr.write(f"\rkeyinit [{bar:<30}] {100 * fraction:5.1f}% {tensor.fqn[:40]:<40}")
            sys.stderr.flush()
        else:
            logger.info("keyinit: %.1f%% (%s)", 100 * fraction, tensor.fqn)

    def _finish_progress(self) -> None:
        if self._show_progress and sys.stderr.isatty():
            sys.stderr.write("\n")

    def report(self, seconds: float) -> InitReport:
        records = []
        for t in self.plan.tensors:
            layout, local = self.layouts.get(id(t), (None, 0))
            if layout is None and t.new:
                layout = "not created"
            elif layout is None:
                tensor = t.tensor
                layout = "meta" if tensor.device.type == "meta" else self.plan.target(t).description
            source = t.source if id(t) in self.layouts else "kept"
            records.append(TensorRecord(t.fqn, t.key_fqn, t.kind, source, math.prod(t.global_shape), local, layout,
                                        self.plan.element_local(t)))
        return InitReport(self.plan.seed, self.plan.root_key.stream, tuple(records), seconds, self.plan.notes)


class _Undo:
    """What puts one tensor back as it was before the writer touched it: its module entries (init code
    may re-create or create it) and, for ``init_model``, its local values (a fill that fails part-way
    must not leave it half-written)."""

    def __init__(self, tensor: PlannedTensor, plan: ModelPlan, keep_values: bool) -> None:
        self.entries = [(module, attr, module._parameters.get(attr, _ABSENT), module._buffers.get(attr, _ABSENT),
                         vars(module).get(attr, _ABSENT), attr in module._non_persistent_buffers_set)
                        for module, attr in tensor.locations()]
        self.saved = None
        if keep_values and not tensor.new and not tensor.recreated:
            out = plan.target(tensor).out
            self.saved = (out, out.detach().clone())

    def __call__(self) -> None:
        with torch.no_grad():
            if self.saved is not None:
                self.saved[0].copy_(self.saved[1])
        for module, attr, parameter, buffer, plain, non_persistent in self.entries:
            for table, old in ((module._parameters, parameter), (module._buffers, buffer)):
                if old is _ABSENT:
                    table.pop(attr, None)
                else:
                    table[attr] = old
            if plain is _ABSENT:
                vars(module).pop(attr, None)
            else:
                vars(module)[attr] = plain
            if non_persistent:
                module._non_persistent_buffers_set.add(attr)
            else:
                module._non_persistent_buffers_set.discard(attr)


_ABSENT = object()


def _may_fail_part_way(tensor: PlannedTensor) -> bool:
    """Whether writing ``tensor`` runs code that can fail after writing part of it: anything but keyinit
    initializers, keyed draws and constants, which planning already checked (their tensors are not
    copied first; only an interrupt or running out of memory can stop them, and the InitError says so)."""
    if tensor.program is None or tensor.new or tensor.recreated:
        return False
    if tensor.origin in ("rule", "pattern", "default") and tensor.rule is not None:
        return not isinstance(tensor.rule[2], Initializer)
    # init code: only keyed draws and constants (kernel fills, checked while planning) need no copy
    return not all(isinstance(node, (Random, Const)) for node in iter_nodes(tensor.program.roots()))


def init_model(
    model: torch.nn.Module,
    seed: Union[int, Key],
    *,
    rules: Rules = None,
    init_method: InitMethod = None,
    init_kwargs: Optional[Mapping[str, Any]] = None,
    ties: Optional[Mapping[str, str]] = None,
    fqn_prefix: Optional[str] = None,
    fqn_map: Optional[FqnMap] = None,
    shards: Optional[Mapping[str, Any]] = None,
    strict: bool = True,
    stream: str = DEFAULT_STREAM,
    registry: Registry = REGISTRY,
    progress: Optional[bool] = None,
) -> InitReport:
    """Initialize every parameter of ``model`` from ``seed``, identically under any layout.

    Args:
        model: a plain, DTensor-sharded (FSDP2/TP/2-D/HSDP) or pipeline-stage module,
            already materialized (use :func:`materialize` for meta-device models).
        seed: an int in ``[0, 2**64)`` or a :class:`keyinit.Key`.
        rules: ``{"fqn glob": initializer}`` and ``{ModuleType: rule}``, above registered rules.
        init_method: existing init code, captured on global-shape stand-ins and replayed per
            shard: a method name called on the topmost modules that have it (torchtitan's
            ``"init_weights"``); a method name or callable that takes a module (HF's
            ``model._init_weights`` or ``"_init_weights"``), applied to every module, children
            first; or a callable taking no arguments, called once.
        init_kwargs: keyword arguments for the init method (e.g. ``{"buffer_device": device}``).
        ties: ``{alias_fqn: fqn}``: the alias is keyed as ``fqn`` (e.g. tied embeddings
            across pipeline stages). Tensors shared within the model are keyed by their first name.
        fqn_prefix, fqn_map: turn a pipeline stage's FQNs into the full model's.
        shards: ``{fqn: keyinit.layouts.ManualShard}`` for hand-cut shards (or declare them
            with ``keyinit.layouts.declare_shard``).
        strict: unmatched FQN rules, ``shards`` keys and ties naming no tensor, and an ``init_method`` no
            module has are errors.
        stream: the stream version (``"v1"``).
        registry: where registered rules are looked up (``keyinit.REGISTRY``).
        progress: show progress (default: only for models over 2**28 elements).

    Returns:
        an :class:`InitReport`. Buffers no rule or init method covers are kept as they are.

    Raises:
        PlanError: before anything is written (uncovered parameters, bad rules, duplicate FQNs,
            initializers that cannot fill their tensor, init code that fails).
        UnkeyedRandomnessError: before anything is written, when init code needs randomness
            keyinit cannot key.
        InitError: writing failed part-way; ``.written`` lists exactly what was written.
    """
    options = InitOptions.pick(locals())
    _reject_meta(model)
    return _plan(model, seed, options, False, progress).apply()


def _reject_meta(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"init_model expects an nn.Module, got {type(model).__name__}")
    meta = [name for name, t in [*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)] if t.device.type == "meta"]
    if meta:
        raise PlanError(f"these tensors are on the meta device: {meta[:8]}{' ...' if len(meta) > 8 else ''}; "
                        f"use keyinit.materialize(model, seed, device=...) for meta-device models", tuple(meta))


def materialize(
    model: torch.nn.Module,
    seed: Union[int, Key],
    *,
    device: Union[torch.device, str, None] = None,
    rules: Rules = None,
    init_method: InitMethod = None,
    init_kwargs: Optional[Mapping[str, Any]] = None,
    ties: Optional[Mapping[str, str]] = None,
    fqn_prefix: Optional[str] = None,
    fqn_map: Optional[FqnMap] = None,
    shards: Optional[Mapping[str, Any]] = None,
    strict: bool = True,
    stream: str = DEFAULT_STREAM,
    registry: Registry = REGISTRY,
    progress: Optional[bool] = None,
) -> InitReport:
    """Allocate a meta-device model on ``device`` and initialize it: ``to_empty`` then :func:`init_model`.

    Works before or after ``fully_shard``/``parallelize_module``. Every parameter AND
    buffer must be covered by a rule or by init code, and init code is captured, before any
    memory is allocated (a :class:`PlanError` or :class:`UnkeyedRandomnessError` leaves the
    model untouched on meta). If allocating or writing fails for any reason, KeyboardInterrupt
    and out-of-memory included, the model is returned to the meta device, so no uninitialized
    memory is ever left behind. The other arguments are :func:`init_model`'s. ``device``
    defaults to ``"cuda"`` when available, else ``"cpu"``.
    """
    options = InitOptions.pick(locals())
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"materialize expects an nn.Module, got {type(model).__name__}")
    return _plan(model, seed, options, True, progress).apply(device=device)


@attrs.frozen(eq=False)
class PlanEntry:
    """One tensor of a :class:`Plan`: what it is and what gives it its values.

    ``origin``: ``"constructor"`` (its ``deferred`` record), ``"default"`` (torch.nn's),
    ``"code"`` (init code), ``"rule"``, ``"pattern"`` or ``"kept"``; ``source``: the label of
    what wrote it last (``"default Linear"``, ``"pattern *.bias"``, ``"init_weights"``, ...);
    ``writers``: the labels of every write its values come from, oldest first; ``rule``: the
    label of the rule or pattern that covers it, if any; ``constructed``: its values start from
    its constructor's record; ``built_deferred``: its module was built by ``keyinit.deferred``;
    ``locations``: every ``(module, attribute)`` it lives at, its owner first."""

    fqn: str
    names: tuple[str, ...]
    key_fqn: str
    kind: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    origin: str
    source: str
    writers: tuple[str, ...]
    rule: Optional[str]
    element_local: bool
    constructed: bool
    built_deferred: bool
    locations: tuple[tuple[torch.nn.Module, str], ...]


def _entry(engine: ModelPlan, t: PlannedTensor) -> PlanEntry:
    from keyinit._engine.deferred import record_of
    from keyinit._engine.program import Read, writes_of

    program = t.program
    writes = () if program is None else (
        writes_of(program.read.version) if isinstance(program.read, Read) else program.writes)
    return PlanEntry(t.fqn, tuple(t.names), t.key_fqn, t.kind, tuple(t.global_shape), t.dtype, t.origin, t.source,
                     tuple(w.label for w in writes), t.rule[1] if t.rule is not None else None,
                     engine.element_local(t), t.record is not None, record_of(t.module) is not None,
                     tuple(t.locations()))


class Plan:
    """What keyinit will write into a model, decided before anything is allocated.

    Made by :func:`plan_init` (``init_model`` and ``materialize`` are ``plan_init(...).apply()``).
    Planning checked everything it can: every tensor is covered, keyable and fillable.

    * :attr:`fqns`: the canonical FQN of every tensor the plan writes, in model order;
    * :meth:`values` ``(fqn, region=None)``: the values of any region of one tensor, computed
      alone (``region`` as in :func:`keyinit.random.normal`: ``None`` for the whole tensor, or
      one entry per dimension: a slice, an int, a range or an index tensor of GLOBAL indices);
      nothing is written into the model. These are exactly the values :meth:`apply` writes
      there, on any layout (the torchdistx ``materialize_tensor`` of keyinit);
    * :meth:`apply`: write every tensor of the model, for the region this process holds
      (``materialize`` on a meta model: allocate on ``device`` first). A plan is applied once.
    """

    def __init__(self, engine: ModelPlan, materializing: bool, progress: Optional[bool], started: float) -> None:
        self._engine = engine
        self._materializing = materializing
        self._progress = progress
        self._started = started
        self._applied = False
        self._by_name = {name: t for t in engine.tensors for name in t.names}

    @property
    def model(self) -> torch.nn.Module:
        return self._engine.model

    @property
    def fqns(self) -> tuple[str, ...]:
        """Canonical FQNs of the tensors the plan writes (tensors it keeps are not listed)."""
        return tuple(t.fqn for t in self._engine.tensors if t.program is not None)

    @property
    def notes(self) -> tuple[str, ...]:
        return self._engine.notes

    @property
    def entries(self) -> tuple[PlanEntry, ...]:
        """Every tensor of the model, kept ones included, in model order."""
        return tuple(_entry(self._engine, t) for t in self._engine.tensors)

    def entry(self, fqn: str) -> PlanEntry:
        """The :class:`PlanEntry` of ``fqn`` (any of its names); ``KeyError`` if the model has none."""
        tensor = self._by_name.get(fqn) if isinstance(fqn, str) else None
        if tensor is None:
            raise KeyError(f"{fqn!r} is not a tensor of this model")
        return _entry(self._engine, tensor)

    def _tensor(self, fqn: str) -> PlannedTensor:
        tensor = self._by_name.get(fqn) if isinstance(fqn, str) else None
        if tensor is None:
            close = sorted(self._by_name)[:8]
            raise KeyError(f"{fqn!r} is not a tensor of this plan (FQNs such as {close})")
        if tensor.program is None:
            raise KeyError(f"{fqn!r}: the plan keeps this tensor as it is (nothing initializes it)")
        return tensor

    def source(self, fqn: str) -> str:
        """What gives ``fqn`` its values (``"constructor"``, ``"default Linear"``, a rule's label, ...)."""
        return self._tensor(fqn).source

    def global_shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._tensor(fqn).global_shape)

    def values(self, fqn: str, region: Any = None, *, device: Union[torch.device, str] = "cpu") -> torch.Tensor:
        """The values of ``region`` of tensor ``fqn`` (any of its names), a new tensor on ``device``."""
        from keyinit.layouts import Target
        from keyinit.regions import make_region

        tensor = self._tensor(fqn)
        try:
            wanted = make_region(tuple(tensor.global_shape), region)
        except (TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"{fqn}: bad region {region!r} for global shape {tuple(tensor.global_shape)}: "
                             f"{exc}") from exc
        out = torch.empty(wanted.region_shape, dtype=tensor.dtype, device=device)
        with torch.no_grad():
            self._engine.write(tensor, Target(tensor.fqn, wanted, out))
        return out

    def apply(self, *, device: Union[torch.device, str, None] = None) -> InitReport:
        """Write every tensor into the model (allocating a meta model on ``device`` first)."""
        if self._applied:
            raise RuntimeError("this Plan was already applied; plan again (keyinit.plan_init) to re-initialize")
        self._applied = True
        if not self._materializing:
            if device is not None:
                raise ValueError("device= is for a meta-device model (materialize); this model is allocated")
            writer = _Writer(self._engine, self._progress)
            writer.run()
            return writer.report(time.perf_counter() - self._started)
        return _materialize(self._engine, self._progress, device, self._started)


def plan_init(model: torch.nn.Module, seed: Union[int, Key], *, materializing: Optional[bool] = None,
              progress: Optional[bool] = None, **options: Any) -> Plan:
    """Plan ``model``'s initialization without allocating or writing anything; returns a :class:`Plan`.

    Takes :func:`init_model`'s keyword arguments. ``materializing`` (default: whether any tensor
    is on the meta device) plans for :func:`materialize`: every buffer must be covered too.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan_init expects an nn.Module, got {type(model).__name__}")
    if materializing is None:
        materializing = any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    return _plan(model, seed, InitOptions.of(options, "plan_init()"), bool(materializing), progress)


def _plan(model: torch.nn.Module, seed: Union[int, Key], options: InitOptions, materializing: bool,
          progress: Optional[bool]) -> Plan:
    started = time.perf_counter()
    return Plan(plan_model(model, seed, options, materializing=materializing), materializing, progress, started)


def _materialize(plan: ModelPlan, progress: Optional[bool], device: Union[torch.device, str, None],
                 started: float) -> InitReport:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = plan.model
    writer = _Writer(plan, progress, device)
    marks = [(t, dict(vars(t.tensor))) for t in plan.tensors if not t.new]
    undo_created = [_Undo(t, plan, keep_values=False) for t in plan.tensors if t.new or t.recreated]
    try:
        model.to_empty(device=device)
        _retie(plan)
        for tensor, attributes in marks:  # to_empty makes new tensors: keep their markers (megatron's, HF's)
            for name, value in attributes.items():
                if not hasattr(tensor.tensor, name):
                    setattr(tensor.tensor, name, value)
        writer.run()
    except BaseException as exc:
        for undo in undo_created:  # what init code created or re-created: the model's own tensors again
            undo()
        torch.nn.Module.to_empty(model, device="meta")  # the base method: an override may be what failed
        for tensor in plan.tensors:
            if tensor.new and tensor.kind == "attribute" and tensor.attr in vars(tensor.module):
                delattr(tensor.module, tensor.attr)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: the model is back on meta
        written = exc.written if isinstance(exc, InitError) else ()
        raise InitError(f"{exc} -- the model was returned to the meta device; nothing is left uninitialized",
                        written) from exc
    return writer.report(time.perf_counter() - started)


def _retie(plan: ModelPlan) -> None:
    """Re-tie plain parameters that ``to_empty`` untied, restoring the model's sharing."""
    for tensor in plan.tensors:
        if tensor.new:
            continue
        first = tensor.tensor
        for module, attr in tensor.distinct_alias_tensors():
            if isinstance(first, torch.nn.Parameter) and type(first) is torch.nn.Parameter:
                setattr(module, attr, first)

