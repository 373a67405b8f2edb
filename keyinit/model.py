"""The model walker: ``init_model`` and ``materialize``.

``init_model(model, seed)`` gives every parameter (and every buffer a rule or
init method covers) the values

    value[i] = initializer(key_for(seed, canonical_fqn))[i]

for each global element ``i`` this process holds, so any layout reproduces the
single-process values bit for bit, with no communication.

It works in two phases. *Plan*: find every tensor, its canonical FQN, ties,
layout and global shape; resolve which rule wins for each; fail with a list of
FQNs if anything is uncovered or ambiguous. Nothing is written during
planning. *Write*: run the winners from lowest to highest precedence:

1. the module's own ``reset_parameters()`` (modules with no module rule), and
   the built-in torch.nn defaults (``keyinit.nn_defaults``);
2. the user's ``init_method`` (a method name such as torchtitan's
   ``"init_weights"``, or a callable applied to every module, such as HF's
   ``model._init_weights``);
3. module-type rules (``init_model(rules={Type: rule})``, then ``keyinit.register``);
4. FQN-pattern rules (``init_model(rules={"glob": init})``, then ``keyinit.register_pattern``).

Init code of steps 1-2 runs under :class:`keyinit._keyed_mode.KeyedInitMode`, so
its random fills are keyed by the tensor's canonical FQN. A tensor planned for
step 3/4 is written once, by its rule; lower steps skip it.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import attrs
import torch

from keyinit import layouts
from keyinit._keyed_mode import KeyedInitMode
from keyinit.errors import InitError, PlanError
from keyinit.fqn import FqnMap, apply_fqn_mapping, canonical_modules
from keyinit.keys import DEFAULT_STREAM, Key, key, key_for
from keyinit.rules import REGISTRY, ModuleRule, Registry, RuleContext

__all__ = ["init_model", "materialize", "InitReport", "TensorRecord", "InitError", "PlanError"]

logger = logging.getLogger("keyinit")

InitMethod = Union[str, Callable[[torch.nn.Module], Any], None]
Rules = Optional[Mapping[Union[str, type], Any]]


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
        """Tensors whose initializer drew the whole tensor on every process (e.g. orthogonal)."""
        return tuple(r.fqn for r in self.records if not r.element_local)

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
        return "\n".join(lines)


@attrs.define(eq=False)
class _Slot:
    """One tensor of the model (a tied tensor is one slot with several names)."""

    fqn: str
    names: list[str]
    key_fqn: str
    kind: str
    module: torch.nn.Module
    module_fqn: str
    attr: str
    aliases: list = attrs.Factory(list)  # further (module, attr) locations of the same tensor
    plan: Optional[tuple[str, Any]] = None  # (source label, initializer) for declarative plans
    method_covered: bool = False
    written_by: Optional[str] = None
    local_numel: int = 0
    element_local: bool = True
    layout: str = ""

    @property
    def tensor(self) -> torch.Tensor:
        return getattr(self.module, self.attr)

    def distinct_alias_tensors(self) -> list[tuple[torch.nn.Module, str]]:
        """Alias locations that no longer hold the same tensor (``to_empty`` unties)."""
        first = self.tensor
        return [(m, a) for m, a in self.aliases if getattr(m, a) is not first]


def _nn_defaults() -> Mapping[type, ModuleRule]:
    from keyinit import nn_defaults

    return nn_defaults.DEFAULT_RULES


def _default_rule(module: torch.nn.Module) -> Optional[tuple[type, ModuleRule]]:
    """The built-in rule for ``module``, unless its class overrides ``reset_parameters``."""
    defaults = _nn_defaults()
    for cls in type(module).__mro__:
        if cls in defaults:
            if getattr(type(module), "reset_parameters", None) is getattr(cls, "reset_parameters", None):
                return cls, defaults[cls]
            return None
    return None


def _storage_identity(tensor: torch.Tensor) -> tuple:
    """What makes two tensor objects the same elements: storage, offset, shape, strides, dtype."""
    local = getattr(tensor, "_local_tensor", None)
    base = local if isinstance(local, torch.Tensor) else tensor
    return (base is not tensor, base.untyped_storage().data_ptr(), base.storage_offset(),
            tuple(base.shape), tuple(base.stride()), base.dtype, tuple(tensor.shape))


def _validate_seed(seed: Union[int, Key], stream: str) -> tuple[Key, int]:
    if isinstance(seed, Key):
        return seed, -1
    return key(seed, stream=stream), seed


class _Walker:
    def __init__(self, model: torch.nn.Module, seed: Union[int, Key], *, rules: Rules, init_method: InitMethod,
                 ties: Optional[Mapping[str, str]], fqn_prefix: Optional[str], fqn_map: Optional[FqnMap],
                 shards: Optional[Mapping[str, Any]], strict: bool, stream: str, registry: Registry,
                 progress: Optional[bool]) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"init_model expects an nn.Module, got {type(model).__name__}")
        self.model = model
        self.root_key, self.seed = _validate_seed(seed, stream)
        self.rules = dict(rules or {})
        self.init_method = init_method
        self.ties = dict(ties or {})
        self.fqn_prefix = fqn_prefix
        self.fqn_map = fqn_map
        self.shards = dict(shards or {})
        self.strict = strict
        self.registry = registry
        self.progress = progress
        self.slots: list[_Slot] = []
        self._by_tensor_id: dict[int, _Slot] = {}
        self._running_module = "<model>"

    # ------------------------------------------------------------------ plan
    def collect(self) -> None:
        seen: dict[int, _Slot] = {}
        by_fqn: dict[str, _Slot] = {}
        for _raw, canonical, module in canonical_modules(self.model):
            for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                for attr, tensor in table.items():
                    if tensor is None:
                        continue
                    local = f"{canonical}.{attr}" if canonical else attr
                    fqn = apply_fqn_mapping(local, self.fqn_prefix, self.fqn_map)
                    if id(tensor) in seen:
                        slot = seen[id(tensor)]
                        if fqn not in slot.names:
                            slot.names.append(fqn)
                        slot.aliases.append((module, attr))
                        continue
                    if fqn in by_fqn:
                        raise PlanError(
                            f"two different tensors have the canonical FQN {fqn!r}; keyinit keys tensors by "
                            f"FQN, so each must be unique (check fqn_map / fqn_prefix and wrapper modules)"
                        )
                    slot = _Slot(fqn, [fqn], fqn, kind, module, canonical, attr)
                    seen[id(tensor)] = slot
                    by_fqn[fqn] = slot
                    self.slots.append(slot)
        self._by_fqn = {name: slot for slot in self.slots for name in slot.names}
        self._slot_by_id = {id(slot.tensor): slot for slot in self.slots}
        self._resolve_ties()

    def _resolve_ties(self) -> None:
        for alias, target in self.ties.items():
            for name in (alias, target):
                if not isinstance(name, str) or not name:
                    raise PlanError(f"ties must map FQN strings to FQN strings, got {alias!r}: {target!r}")
            if alias not in self._by_fqn and target not in self._by_fqn and self.strict:
                raise PlanError(
                    f"tie {alias!r} -> {target!r} names no tensor of this model (neither FQN exists); "
                    f"pass strict=False for pipeline stages that hold neither"
                )
        for slot in self.slots:
            for name in slot.names:
                if name in self.ties:
                    slot.key_fqn = self.ties[name]
                    break
            else:
                slot.key_fqn = slot.names[0]

    def _module_slots(self, module: torch.nn.Module) -> dict[str, _Slot]:
        found = {}
        for slot in self.slots:
            if slot.module is module:
                found[slot.attr] = slot
            for alias_module, alias_attr in slot.aliases:
                if alias_module is module:
                    found[alias_attr] = slot
        return found

    def _global_shape(self, slot: _Slot) -> tuple[int, ...]:
        return layouts.global_shape(slot.tensor, fqn=slot.fqn, module=slot.module, name=slot.attr,
                                    shards=self.shards)

    def collect_after_move(self) -> None:
        """Re-tie plain tensors that ``to_empty`` untied, restoring the model's sharing."""
        for slot in self.slots:
            first = slot.tensor
            for module, attr in slot.distinct_alias_tensors():
                if isinstance(first, torch.nn.Parameter) and type(first) is torch.nn.Parameter:
                    setattr(module, attr, first)

    def _context(self, module: torch.nn.Module, module_fqn: str) -> RuleContext:
        direct = {**module._parameters, **module._buffers}
        shapes, dtypes = {}, {}
        for attr, tensor in direct.items():
            if tensor is None:
                continue
            slot = self._slot_by_id.get(id(tensor))
            shapes[attr] = self._global_shape(slot) if slot is not None else tuple(tensor.shape)
            dtypes[attr] = tensor.dtype
        return RuleContext(module_fqn, shapes, dtypes)

    def plan(self) -> None:
        self._fallback_modules: list[tuple[torch.nn.Module, str]] = []
        type_rules = {k: v for k, v in self.rules.items() if isinstance(k, type)}
        pattern_rules = [(k, v) for k, v in self.rules.items() if isinstance(k, str)]
        bad = [k for k in self.rules if not isinstance(k, (str, type))]
        if bad:
            raise PlanError(f"rules keys must be FQN glob strings or nn.Module types, got {bad!r}")
        patterns = pattern_rules + list(self.registry.patterns)
        modules: dict[int, tuple[torch.nn.Module, str]] = {}
        for _raw, canonical, module in canonical_modules(self.model):
            modules.setdefault(id(module), (module, canonical))

        # 4. FQN patterns
        matched: set[str] = set()
        for slot in self.slots:
            for pattern, initializer in patterns:
                if any(fnmatch.fnmatchcase(name, pattern) for name in slot.names):
                    matched.add(pattern)  # matched, even where an earlier pattern wins
                    if slot.plan is None:
                        slot.plan = (f"pattern {pattern}", initializer)
        unmatched = [p for p, _ in pattern_rules if p not in matched]
        if unmatched and self.strict:
            raise PlanError(f"FQN rules matched no tensor of this model: {unmatched}; pass strict=False to allow")

        # 1. built-in defaults, then 3. module-type rules, per tensor (a rule may cover only some tensors)
        for module, module_fqn in modules.values():
            if not self._module_slots(module):
                continue
            default = _default_rule(module)
            if default is not None:
                self._apply_module_rule(module, module_fqn, default[1], f"default {default[0].__name__}")
            user = next(((cls, type_rules[cls]) for cls in type(module).__mro__ if cls in type_rules), None)
            user = user or self.registry.module_rule(type(module))
            if user is not None:
                self._apply_module_rule(module, module_fqn, user[1], f"rule {user[0].__name__}")
        # 1. reset_parameters for modules with tensors no declarative rule covers
        for module, module_fqn in modules.values():
            uncovered = [s for s in self._module_slots(module).values() if s.plan is None and s.module is module]
            if uncovered and callable(getattr(module, "reset_parameters", None)):
                self._fallback_modules.append((module, module_fqn))
                for slot in uncovered:
                    slot.method_covered = True

        # 2. the user's init method
        self._method_roots: list[tuple[torch.nn.Module, str]] = []
        if self.init_method is not None:
            if isinstance(self.init_method, str):
                covered: set[int] = set()
                for _raw, canonical, module in canonical_modules(self.model):
                    if id(module) in covered:
                        continue
                    if callable(getattr(module, self.init_method, None)):
                        self._method_roots.append((module, canonical))
                        for sub in module.modules():
                            covered.add(id(sub))
                if not self._method_roots and self.strict:
                    raise PlanError(f"init_method {self.init_method!r}: no module of this model has that method")
                for slot in self.slots:
                    if id(slot.module) in covered:
                        slot.method_covered = True
            elif callable(self.init_method):
                for slot in self.slots:
                    slot.method_covered = True
            else:
                raise PlanError(f"init_method must be a method name or a callable, got {self.init_method!r}")

    def _apply_module_rule(self, module: torch.nn.Module, module_fqn: str, rule: ModuleRule, label: str) -> None:
        own = self._module_slots(module)
        where = module_fqn or "<root>"
        try:
            produced = rule(module, self._context(module, module_fqn))
        except Exception as exc:
            raise PlanError(f"{label} raised while planning {where}: {exc!r}") from exc
        if not isinstance(produced, Mapping):
            raise PlanError(f"{label} for {where} must return a mapping of tensor name to initializer, "
                            f"got {type(produced).__name__}")
        for name, initializer in produced.items():
            if name not in own:
                raise PlanError(f"{label} for {where} returned {name!r}, which is not a parameter or buffer "
                                f"of it (it has {sorted(own)})")
            if not callable(initializer):
                raise PlanError(f"{label} for {own[name].fqn}: {initializer!r} is not an initializer")
            slot = own[name]
            if slot.plan is not None and (slot.plan[0].startswith("pattern") or slot.module is not module):
                continue  # a pattern wins; a tied tensor follows its first name's module
            slot.plan = (label, initializer)

    def check_coverage(self, materializing: bool) -> None:
        missing = [s.fqn for s in self.slots if s.plan is None and not s.method_covered
                   and (materializing or s.kind == "parameter")]
        if missing:
            raise PlanError(
                "no rule or init method covers these tensors: " + ", ".join(missing) + ". Register a rule "
                "(@keyinit.register(ModuleType) or rules={'fqn glob': initializer}), give the module "
                "reset_parameters(), or pass init_method=.", tuple(missing)
            )

    # ------------------------------------------------------------------ write
    def _target(self, slot: _Slot, module: Optional[torch.nn.Module] = None, attr: Optional[str] = None) -> layouts.Target:
        module, attr = (module, attr) if module is not None else (slot.module, slot.attr)
        return layouts.target_for(getattr(module, attr), fqn=slot.fqn, module=module, name=attr, shards=self.shards)

    def _write(self, slot: _Slot, initializer: Any, source: str) -> None:
        target = self._target(slot)
        slot_key = key_for(self.root_key, slot.key_fqn)
        with torch.no_grad():
            initializer(slot_key, target)
            for module, attr in slot.distinct_alias_tensors():
                initializer(slot_key, self._target(slot, module, attr))
        slot.written_by = source
        slot.layout = target.description
        slot.element_local = getattr(initializer, "element_local", True)
        slot.local_numel = target.out.numel() if slot.element_local else math.prod(target.global_shape)
        self._tick(slot)

    def _lookup(self, tensor: torch.Tensor) -> Optional[_Slot]:
        slot = self._by_tensor_id.get(id(tensor))
        if slot is not None and (slot.tensor is tensor or any(getattr(m, a) is tensor for m, a in slot.aliases)):
            return slot
        return self._by_storage.get(_storage_identity(tensor))  # ``param.data`` and other full aliases

    def _run_methods(self, label: str, calls: list[tuple[torch.nn.Module, str, Callable[[], Any]]]) -> None:
        current_label = {"value": label}

        def write(slot: _Slot, initializer: Any) -> None:
            if slot.plan is not None and not slot.plan[0].startswith("default"):
                return  # a higher-precedence rule writes it later
            self._write(slot, initializer, current_label["value"])

        mode = KeyedInitMode(self._lookup, write, lambda: self._running_module)
        before = {id(s): self._version(s) for s in self.slots}
        for module, module_fqn, call in calls:
            self._running_module = f"{type(module).__name__} at {module_fqn or '<root>'}"
            current_label["value"] = label
            with torch.no_grad(), mode:
                call()
        for slot in self.slots:
            if slot.written_by is None and self._version(slot) != before[id(slot)]:
                slot.written_by = label
                target = self._target(slot)
                slot.layout, slot.local_numel = target.description, target.out.numel()

    @staticmethod
    def _version(slot: _Slot) -> int:
        tensor = slot.tensor
        local = getattr(tensor, "_local_tensor", tensor)
        return local._version

    def write_all(self) -> None:
        self._by_tensor_id = {id(s.tensor): s for s in self.slots}
        self._by_tensor_id.update({id(getattr(m, a)): s for s in self.slots for m, a in s.aliases})
        self._by_storage = {_storage_identity(s.tensor): s for s in self.slots}
        self._total = sum(math.prod(s.tensor.shape) for s in self.slots)
        self._done = 0
        self._started = time.perf_counter()
        self._last_tick = 0.0
        self._show_progress = self.progress if self.progress is not None else self._total >= 1 << 28
        try:
            # 1. reset_parameters fallback and built-in defaults
            self._run_methods("reset_parameters", [(m, f, m.reset_parameters) for m, f in self._fallback_modules])
            for slot in self.slots:
                if slot.plan is not None and slot.plan[0].startswith("default"):
                    self._write(slot, slot.plan[1], slot.plan[0])
            # 2. the user's init method
            if isinstance(self.init_method, str):
                name = self.init_method
                self._run_methods(name, [(m, f, getattr(m, name)) for m, f in self._method_roots])
            elif callable(self.init_method):
                fn = self.init_method
                seen: set[int] = set()
                calls = []
                for _raw, canonical, module in reversed(list(canonical_modules(self.model))):
                    if id(module) not in seen:
                        seen.add(id(module))
                        calls.append((module, canonical, lambda m=module: fn(m)))
                self._run_methods(getattr(fn, "__name__", "init_method"), calls)
            # 3-4. user module rules and FQN patterns
            for slot in self.slots:
                if slot.plan is not None and not slot.plan[0].startswith("default"):
                    self._write(slot, slot.plan[1], slot.plan[0])
        except Exception as exc:
            written = tuple(s.fqn for s in self.slots if s.written_by is not None)
            raise InitError(
                f"initialization failed part-way ({type(exc).__name__}: {exc}); these tensors were already "
                f"written: {list(written) or 'none'}; every other tensor is unchanged",
                written,
            ) from exc
        finally:
            self._finish_progress()
        not_written = [s.fqn for s in self.slots if s.written_by is None and s.method_covered and s.plan is None
                       and s.kind == "parameter"]
        if not_written:
            raise InitError(
                "the init methods ran but never wrote these parameters: " + ", ".join(not_written)
                + "; give them a rule", tuple(s.fqn for s in self.slots if s.written_by is not None))

    def _tick(self, slot: _Slot) -> None:
        self._done += math.prod(slot.tensor.shape)
        if not self._show_progress:
            return
        now = time.perf_counter()
        if now - self._last_tick < 0.5 and self._done < self._total:
            return
        self._last_tick = now
        fraction = self._done / max(self._total, 1)
        if sys.stderr.isatty():
            bar = "#" * int(30 * fraction)
            sys.stderr.write(f"\rkeyinit [{bar:<30}] {100 * fraction:5.1f}% {slot.fqn[:40]:<40}")
            sys.stderr.flush()
        else:
            logger.info("keyinit: %.1f%% (%s)", 100 * fraction, slot.fqn)

    def _finish_progress(self) -> None:
        if getattr(self, "_show_progress", False) and sys.stderr.isatty():
            sys.stderr.write("\n")

    def report(self, seconds: float) -> InitReport:
        records = []
        for s in self.slots:
            tensor = s.tensor
            source = s.written_by or "kept"
            layout = s.layout or ("meta" if tensor.device.type == "meta" else self._target(s).description)
            records.append(TensorRecord(s.fqn, s.key_fqn, s.kind, source, math.prod(self._global_shape(s)),
                                        s.local_numel, layout, s.element_local))
        return InitReport(self.seed, self.root_key.stream, tuple(records), seconds)


def init_model(
    model: torch.nn.Module,
    seed: Union[int, Key],
    *,
    rules: Rules = None,
    init_method: InitMethod = None,
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
        init_method: existing init code to run keyed: a method name called on the topmost
            modules that have it (torchtitan's ``"init_weights"``) or a callable applied to
            every module (HF's ``model._init_weights``).
        ties: ``{alias_fqn: fqn}``: the alias is keyed as ``fqn`` (e.g. tied embeddings
            across pipeline stages). Tensors shared within the model are keyed by their first name.
        fqn_prefix, fqn_map: turn a pipeline stage's FQNs into the full model's.
        shards: ``{fqn: keyinit.layouts.ManualShard}`` for hand-cut shards (or declare them
            with ``keyinit.layouts.declare_shard``).
        strict: unmatched FQN rules, ties naming no tensor, and an ``init_method`` no module has are errors.
        stream: the stream version (``"v1"``).
        registry: where registered rules are looked up (``keyinit.REGISTRY``).
        progress: show progress (default: only for models over 2**28 elements).

    Returns:
        an :class:`InitReport`. Buffers no rule or init method covers are kept as they are.

    Raises:
        PlanError: before anything is written (uncovered parameters, bad rules, duplicate FQNs, ...).
        InitError: a rule failed part-way; ``.written`` lists exactly what was written.
    """
    start = time.perf_counter()
    walker = _Walker(model, seed, rules=rules, init_method=init_method, ties=ties, fqn_prefix=fqn_prefix,
                     fqn_map=fqn_map, shards=shards, strict=strict, stream=stream, registry=registry,
                     progress=progress)
    walker.collect()
    _reject_meta(walker)
    walker.plan()
    walker.check_coverage(materializing=False)
    walker.write_all()
    return walker.report(time.perf_counter() - start)


def _reject_meta(walker: _Walker) -> None:
    meta = [s.fqn for s in walker.slots if s.tensor.device.type == "meta"]
    if meta:
        raise PlanError(f"these tensors are on the meta device: {meta[:8]}{' ...' if len(meta) > 8 else ''}; "
                        f"use keyinit.materialize(model, seed, device=...) for meta-device models")


def materialize(
    model: torch.nn.Module,
    seed: Union[int, Key],
    *,
    device: Union[torch.device, str, None] = None,
    **kwargs: Any,
) -> InitReport:
    """Allocate a meta-device model on ``device`` and initialize it: ``to_empty`` then :func:`init_model`.

    Works before or after ``fully_shard``/``parallelize_module``. Every parameter AND
    buffer must be covered by a rule or an init method; this is checked before any memory is
    allocated. If writing fails, the model is returned to the meta device, so no
    uninitialized memory is ever left behind. Takes :func:`init_model`'s keyword arguments.
    """
    start = time.perf_counter()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    walker = _Walker(model, seed, **_walker_kwargs(kwargs))
    walker.collect()
    walker.plan()
    walker.check_coverage(materializing=True)
    model.to_empty(device=device)
    walker.collect_after_move()
    try:
        walker.write_all()
        uncovered = [s.fqn for s in walker.slots if s.written_by is None]
        if uncovered:
            raise InitError("the init methods ran but never wrote: " + ", ".join(uncovered)
                            + "; give these tensors a rule", ())
    except InitError as exc:
        model.to_empty(device="meta")
        raise InitError(f"{exc} -- the model was returned to the meta device; nothing is left uninitialized",
                        exc.written) from exc
    return walker.report(time.perf_counter() - start)


def _walker_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = {"rules": None, "init_method": None, "ties": None, "fqn_prefix": None, "fqn_map": None,
               "shards": None, "strict": True, "stream": DEFAULT_STREAM, "registry": REGISTRY, "progress": None}
    unknown = set(kwargs) - set(allowed)
    if unknown:
        raise TypeError(f"materialize() got unexpected keyword arguments {sorted(unknown)}")
    return {**allowed, **kwargs}
