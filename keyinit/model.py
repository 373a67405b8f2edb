"""The public face of model initialization: ``plan_init``, ``Plan``, ``PlanEntry``, ``init_model`` and ``materialize``.

``init_model(model, seed)`` gives every parameter (and every buffer a rule or
init code covers) the values

    value[i] = program(key_for(seed, canonical_fqn))[i]

for each global element ``i`` this process holds, so any layout reproduces the
single-process values bit for bit, with no communication.

It works in two phases. *Plan* (:mod:`keyinit._engine.planning.plan`): find every tensor, its
canonical FQN, ties and global shape; resolve rules; capture the model's own
init code on global-shape stand-ins; fail with a list of FQNs if anything is
uncovered, unkeyable or cannot be filled. Nothing is allocated or written
while planning. *Write* (:mod:`keyinit._engine.writing.writer`): replay each tensor's
program for the region this process holds (:mod:`keyinit._engine.programs.replay`),
lowest precedence first (built-in defaults, init code, module rules, FQN
patterns), so a failure part-way leaves an exact record of what was written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional, Union

import attrs
import torch

from keyinit.errors import InitError, PlanError
from keyinit.fqn import FqnMap
from keyinit.keys import DEFAULT_STREAM, Key
from keyinit._engine.planning.options import InitMethod, InitOptions, Rules
from keyinit._engine.planning.plan import plan_model
from keyinit._engine.planning.planned import ModelPlan, PlannedTensor
from keyinit._engine.writing.kept import Loaded, keep_allocated, loaded_names, refuse_allocated
from keyinit._engine.writing.writer import InitReport, TensorRecord, materialize_plan, write_plan
from keyinit.rules import REGISTRY, Registry

__all__ = ["init_model", "materialize", "plan_init", "Plan", "PlanEntry", "InitReport", "TensorRecord", "InitError", "PlanError"]

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
    loaded: Loaded = None,
) -> InitReport:
    """Allocate a meta-device model on ``device`` and initialize it: ``to_empty`` then :func:`init_model`.

    Works before or after ``fully_shard``/``parallelize_module``. Every parameter AND
    buffer must be covered by a rule or by init code, and init code is captured, before any
    memory is allocated (a :class:`PlanError` or :class:`UnkeyedRandomnessError` leaves the
    model untouched on meta). If allocating or writing fails for any reason, KeyboardInterrupt
    and out-of-memory included, the model is returned to the meta device, so no uninitialized
    memory is ever left behind. The other arguments are :func:`init_model`'s. ``device``
    defaults to ``"cuda"`` when available, else ``"cpu"``.

    Tensors not on meta that the user loaded (``load_state_dict(sd, assign=True)``) are kept as they are.
    ``loaded``: the state dict loaded (its keys) or the FQNs of the tensors loaded; exactly those are
    kept and every other tensor keyinit covers is written. Not given, a real tensor is kept unless
    captured init code writes it (a constructor may have drawn it from torch's global RNG, as HF
    DiffLlama's ``torch.normal(..., size=...)`` does under ``torch.device("meta")``): then a
    :class:`PlanError` names those tensors; ``loaded=()`` writes them.
    """
    options = InitOptions.pick(locals())
    refuse_allocated(model)  # not a module, or nothing on meta (materialize called twice): an error
    return _plan(model, seed, options, True, progress, loaded_names(loaded)).apply(device=device)


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
    from keyinit._engine.deferred.deferred import record_of
    from keyinit._engine.programs.program import Read, writes_of

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
        from keyinit.regions import _integer, make_region

        tensor = self._tensor(fqn)
        # An int entry indexes like ``full[i]``: it takes that one index and drops the dimension.
        dropped: list[int] = []
        entries = region
        if isinstance(region, (tuple, list)):
            entries = list(region)
            for dim, entry in enumerate(entries):
                index = _integer(entry)
                if index is not None:
                    entries[dim] = [index]
                    dropped.append(dim)
            entries = tuple(entries)
        try:
            wanted = make_region(tuple(tensor.global_shape), entries)
        except (TypeError, ValueError, IndexError) as exc:
            raise ValueError(f"{fqn}: bad region {region!r} for global shape {tuple(tensor.global_shape)}: "
                             f"{exc}") from exc
        out = torch.empty(wanted.region_shape, dtype=tensor.dtype, device=device)
        with torch.no_grad():
            self._engine.write(tensor, Target(tensor.fqn, wanted, out))
        if dropped:
            out = out.reshape([n for dim, n in enumerate(wanted.region_shape) if dim not in dropped])
        return out

    def apply(self, *, device: Union[torch.device, str, None] = None) -> InitReport:
        """Write every tensor into the model (allocating a meta model on ``device`` first)."""
        if self._applied:
            raise RuntimeError("this Plan was already applied; plan again (keyinit.plan_init) to re-initialize")
        self._applied = True
        if not self._materializing:
            if device is not None:
                raise ValueError("device= is for a meta-device model (materialize); this model is allocated")
            return write_plan(self._engine, self._progress, self._started)
        return materialize_plan(self._engine, self._progress, device, self._started)


def plan_init(model: torch.nn.Module, seed: Union[int, Key], *, materializing: Optional[bool] = None,
              progress: Optional[bool] = None, loaded: Loaded = None, **options: Any) -> Plan:
    """Plan ``model``'s initialization without allocating or writing anything; returns a :class:`Plan`.

    Takes :func:`init_model`'s keyword arguments. ``materializing`` (default: whether any tensor
    is on the meta device) plans for :func:`materialize`: every buffer must be covered too, and
    the tensors it keeps (``loaded``, as :func:`materialize` takes it) are decided.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan_init expects an nn.Module, got {type(model).__name__}")
    if materializing is None:
        materializing = any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    names = loaded_names(loaded)
    if names is not None and not materializing:
        raise ValueError("loaded= is for a meta-device model (materialize); this model is allocated")
    return _plan(model, seed, InitOptions.of(options, "plan_init()"), bool(materializing), progress, names)


def _plan(model: torch.nn.Module, seed: Union[int, Key], options: InitOptions, materializing: bool,
          progress: Optional[bool], loaded: Optional[frozenset[str]] = None) -> Plan:
    started = time.perf_counter()
    engine = plan_model(model, seed, options, materializing=materializing)
    if materializing:  # what materialize keeps as it is: after the keys are given (they do not depend on it)
        keep_allocated(engine, loaded, options.strict)
    return Plan(engine, materializing, progress, started)
