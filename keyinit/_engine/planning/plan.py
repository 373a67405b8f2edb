"""Planning: the program of every tensor of a model, decided before anything is allocated or written.

:func:`plan_model` finds every parameter and buffer (canonical FQN, ties, global shape),
resolves which declarative rule covers each (FQN patterns, module rules, the built-in
torch.nn defaults), runs the model's own init code under :class:`keyinit._engine.capture.capture.Capture`
on global-shape stand-ins, and gives every tensor a :class:`keyinit._engine.programs.program.SlotProgram`:

1. the built-in default of its module (``keyinit.nn_defaults``), if any;
2. then what ``reset_parameters()`` (modules no declarative rule fully covers) and the
   user's ``init_method`` wrote on top of it, in that order;
3. unless a module-type rule or, above it, an FQN pattern covers the tensor: then the
   rule's initializer alone, and whatever init code did to it is discarded.

Draws are keyed by where they land (:func:`keyinit._engine.programs.program.assign_keys`). Every error a
plan can see is raised before any memory is allocated (the checks of the finished plan are
:mod:`keyinit._engine.planning.plan_checks`): uncovered tensors
(:class:`PlanError` with ``.fqns``), randomness that cannot be keyed
(:class:`UnkeyedRandomnessError`), initializers that cannot fill their tensor.

One module: the planner's steps (collect, resolve rules, build the init calls, capture) run in one
order over one shared state (the tensors by FQN, their records, the rules that cover them), and
each step's result is the next one's input; the checks that read only the finished plan are
:mod:`keyinit._engine.planning.plan_checks`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

from keyinit import layouts
from keyinit._engine.programs.guard import model_kept, no_writes, storages_of
from keyinit._engine.planning.shared_draws import warn_shared_draws
from keyinit._engine.capture.capture import Capture, CaptureError, LazyTensor
from keyinit._engine.planning.init_code import (
    Installed,
    PerModuleCall,
    bind_call,
    child_fqn,
    parametrization_start,
    parametrized_names,
    takes_module,
    through_right_inverse,
)
from keyinit.errors import PlanError, UnkeyedRandomnessError
from keyinit.fqn import apply_fqn_mapping, canonical_modules
from keyinit.keys import Key, key
from keyinit._engine.deferred.lazy import check_lazy
from keyinit._engine.planning.plan_checks import (check_plan, check_renumbered_keys, check_scripted, check_shared_memory,
                                         shared_records_note, unused_init_code_note)
from keyinit._engine.planning.options import InitOptions
from keyinit._engine.planning.planned import ModelPlan, PlannedTensor
from keyinit._engine.deferred.deferred import origin_of, record_of, renumbered_as, seed_storage
from keyinit._engine.capture.escape import derived_attributes, forget_escaped, sweep_escaped
from keyinit._engine.programs.program import Alloc, Node, Random, Read, SlotProgram, Storage, StridedView
from keyinit.rules import ModuleRule, RuleContext, initializer_problem
from keyinit.walk import tensors as model_tensors

__all__ = ["plan_model"]

def _is_hf_pretrained(module: Any) -> bool:
    """An instance of transformers' ``PreTrainedModel`` (checked by class, without importing transformers)."""
    return isinstance(module, torch.nn.Module) and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(module).__mro__)


def _nn_defaults() -> Mapping[type, ModuleRule]:
    from keyinit import nn_defaults

    return nn_defaults.DEFAULT_RULES


def _default_rule(module: torch.nn.Module) -> Optional[tuple[type, ModuleRule]]:
    """The built-in rule for ``module``, unless its class overrides ``reset_parameters`` or torch's hook-based
    weight_norm / spectral_norm / pruning replaced the parameter it writes (``weight`` became ``weight_g``...)."""
    if derived_attributes(module):
        return None
    defaults = _nn_defaults()
    for cls in type(module).__mro__:
        if cls in defaults:
            if getattr(type(module), "reset_parameters", None) is getattr(cls, "reset_parameters", None):
                return cls, defaults[cls]
            return None
    return None


def _root_key(seed: Union[int, Key], stream: str) -> tuple[Key, int]:
    if isinstance(seed, Key):
        return seed, -1
    return key(seed, stream=stream), seed


def _initializer_program(fqn: str, shape: tuple[int, ...], dtype: torch.dtype, label: str, initializer: Any) -> SlotProgram:
    """A program that is one whole-tensor fill by ``initializer`` (keyed by the tensor's key)."""
    local = getattr(initializer, "element_local", True)
    storage = Storage(math.prod(shape), dtype, fqn)
    storage.write(StridedView.contiguous(shape), Random(shape, dtype, label, label, initializer, element_local=local), label)
    return SlotProgram.of_storage(fqn, shape, storage)


def _check_tie_chains(ties: Mapping[str, str]) -> None:
    """A tie's target must not itself be tied elsewhere: a chain keys the two ends differently and a
    cycle keys each tensor by the other's name."""
    for alias, target in ties.items():
        if target != alias and target in ties and ties[target] != target:
            kind = "a cycle" if ties[target] == alias else "a chain"
            raise PlanError(f"ties form {kind}: {alias!r} -> {target!r} -> {ties[target]!r}; tie every alias "
                            f"directly to the one FQN that keys them all", (alias, target))


def _check_tie_shapes(ties: Mapping[str, str], by_fqn: Mapping[str, PlannedTensor]) -> None:
    """Tied tensors that are both here must have one global shape (one key, one set of values)."""
    for alias, target in ties.items():
        a, b = by_fqn.get(alias), by_fqn.get(target)
        if a is not None and b is not None and a is not b and a.global_shape != b.global_shape:
            raise PlanError(f"tie {alias!r} -> {target!r} joins tensors of different global shapes "
                            f"{a.global_shape} and {b.global_shape}", (alias, target))


class _Planner:
    def __init__(self, model: torch.nn.Module, seed: Union[int, Key], options: InitOptions) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"init_model expects an nn.Module, got {type(model).__name__}")
        self.model = model
        self.root_key, self.seed = _root_key(seed, options.stream)
        self.rules = dict(options.rules or {})
        self.init_method = options.init_method
        init_kwargs = options.init_kwargs
        if init_kwargs is not None and not isinstance(init_kwargs, Mapping):
            raise PlanError(f"init_kwargs must be a mapping of keyword arguments, got {type(init_kwargs).__name__}")
        self.init_kwargs = dict(init_kwargs or {})
        self.ties = dict(options.ties or {})
        self.fqn_prefix = options.fqn_prefix
        self.fqn_map = options.fqn_map
        self.shards = dict(options.shards or {})
        self.strict = options.strict
        self.registry = options.registry
        self.tensors: list[PlannedTensor] = []
        self.notes: list[str] = []
        self.emptied: dict[str, str] = {}  # fqn -> the init code whose to_empty left it with nothing written
        # rules for parametrized tensors: (id(module), name) -> (module, fqn, name, kind, label, initializer)
        self.parametrized: dict[tuple[int, str], tuple] = {}

    # ------------------------------------------------------------------ tensors
    def collect(self) -> None:
        by_fqn: dict[str, PlannedTensor] = {}
        for found in model_tensors(self.model):
            names = list(dict.fromkeys(apply_fqn_mapping(n, self.fqn_prefix, self.fqn_map) for n in found.names))
            fqn = names[0]
            if fqn in by_fqn:
                raise PlanError(
                    f"two different tensors have the canonical FQN {fqn!r}; keyinit keys tensors by "
                    f"FQN, so each must be unique (check fqn_map / fqn_prefix and wrapper modules)", (fqn,)
                )
            module_fqn = found.fqn[: -len(found.attr) - 1] if found.fqn != found.attr else ""
            entry = PlannedTensor(fqn, names, fqn, found.kind, found.module, module_fqn, found.attr,
                                  aliases=[(m, a) for m, a, _ in found.locations[1:]])
            by_fqn[fqn] = entry
            self.tensors.append(entry)
        self.by_fqn = {name: t for t in self.tensors for name in t.names}
        self._own_index: dict[int, dict[str, PlannedTensor]] = {}
        for t in self.tensors:
            for m, a in t.locations():
                self._own_index.setdefault(id(m), {})[a] = t
        self._resolve_ties()
        self.shards = layouts.resolve_shard_names(self.shards, {n: t.fqn for t in self.tensors for n in t.names},
                                                  strict=self.strict)
        for t in self.tensors:
            try:
                t.global_shape = layouts.global_shape(t.tensor, fqn=t.fqn, module=t.module, name=t.attr,
                                                      shards=self.shards)
            except (ValueError, TypeError) as exc:
                message = str(exc) if str(exc).startswith(t.fqn) else f"{t.fqn}: {exc}"
                raise PlanError(message, (t.fqn,)) from exc
            t.dtype = t.tensor.dtype
        _check_tie_shapes(self.ties, self.by_fqn)
        check_scripted(self.tensors)
        check_shared_memory(self.tensors)
        self._find_records()

    def _find_records(self) -> None:
        """Each tensor's constructor record (:func:`keyinit.deferred`), where its module has one.

        A record that wrote nothing (``torch.empty`` left for later init code) is no record. A
        record of another shape (the tensor was replaced after construction) is not used."""
        self.constructed: set[int] = set()  # modules built by keyinit.deferred whose records hold values
        renumbered: list[PlannedTensor] = []
        raw_names: dict[int, str] = {}
        for raw, _canonical, m in canonical_modules(self.model):
            raw_names.setdefault(id(m), raw)  # a module at two paths (a layer inserted twice): its first, t.fqn's
        for t in self.tensors:
            found: list[tuple[torch.nn.Module, str, Node]] = []
            for module, attr in t.locations():
                record = record_of(module)
                node = record.value(attr) if record is not None else None
                if node is None or (isinstance(node, Read) and isinstance(node.version, Alloc)):
                    continue
                if tuple(node.shape) != tuple(t.global_shape):
                    self.notes.append(f"{t.fqn}: its constructor record has shape {tuple(node.shape)} but the "
                                      f"tensor is {tuple(t.global_shape)} (replaced after construction); not used")
                    continue
                found.append((module, attr, node))
            if not found:
                continue
            module, attr, node = found[0]
            if any(other is not node for _, _, other in found[1:]):
                # tied after construction (``model.emb.weight = model.head.weight``): each name's module
                # recorded its own value; the tensor holds the one of the module it was built in, as in eager
                origin = origin_of(t.tensor)
                mine = [f for f in found if f[2] is origin]
                if mine:
                    module, attr, node = mine[0]
                else:
                    self.notes.append(f"{t.fqn}: tied after construction to {', '.join(n for n in t.names[1:])} "
                                      f"whose constructors recorded other values, and the tensor no longer tells "
                                      f"which one it was built as (replaced since); the record of {t.fqn} is used")
            t.record = node
            self.constructed.update(id(m) for m, _, _ in found)
            raw = f"{raw_names[id(module)]}.{attr}" if raw_names.get(id(module)) else attr
            built = renumbered_as(raw, record_of(module).fqns.get(attr))
            # only where the canonical name is the module path (megatron's experts are renamed to their global index)
            if built is not None and raw == t.fqn == t.key_fqn and not (self.fqn_prefix or self.fqn_map):
                t.key_fqn = built  # its constructor built it as `built` (depth-scaled inits): that model's values
                renumbered.append(t)
        shared = shared_records_note(self.tensors)
        if shared is not None:
            self.notes.append(shared)
        if renumbered:
            check_renumbered_keys(self.tensors, renumbered)
            shown = ", ".join(f"{t.fqn} as {t.key_fqn}" for t in renumbered[:4])
            self.notes.append(f"{len(renumbered)} tensors sit at other ModuleList indices than they were built at "
                              f"(renumbered after construction, as `del layers[0]` does) and are keyed by the names "
                              f"they were built with, so they get the full model's values: "
                              f"{shown}{' ...' if len(renumbered) > 4 else ''}")

    def _resolve_ties(self) -> None:
        for alias, target in self.ties.items():
            for name in (alias, target):
                if not isinstance(name, str) or not name:
                    raise PlanError(f"ties must map FQN strings to FQN strings, got {alias!r}: {target!r}")
            if alias not in self.by_fqn and target not in self.by_fqn and self.strict:
                raise PlanError(
                    f"tie {alias!r} -> {target!r} names no tensor of this model (neither FQN exists); "
                    f"pass strict=False for pipeline stages that hold neither"
                )
        _check_tie_chains(self.ties)
        for t in self.tensors:
            t.key_fqn = next((self.ties[name] for name in t.names if name in self.ties), t.names[0])

    def _own(self, module: torch.nn.Module) -> dict[str, PlannedTensor]:
        """``{attr: tensor}`` of the tensors ``module`` holds directly (aliases included)."""
        return dict(self._own_index.get(id(module), {}))

    def _context(self, module: torch.nn.Module, module_fqn: str) -> RuleContext:
        own = self._own(module)
        shapes = {attr: t.global_shape for attr, t in own.items()}
        dtypes = {attr: t.dtype for attr, t in own.items()}
        for name in parametrized_names(module):
            shapes[name], dtypes[name] = self._parametrized_value(module, name)
        return RuleContext(module_fqn, shapes, dtypes)

    def _originals_recorded(self, module: torch.nn.Module, name: str) -> bool:
        """Whether the originals of ``module.<name>``'s parametrizations hold a constructor's record
        (``weight_norm``/``spectral_norm`` applied inside a :func:`keyinit.deferred` constructor)."""
        plist = module.parametrizations[name]
        return any(t.record is not None for t in self.tensors
                   if any(m is plist and attr.startswith("original") for m, attr in t.locations()))

    def _parametrized_value(self, module: torch.nn.Module, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """Global shape and dtype of a parametrized tensor (``module.weight`` under ``weight_norm``):
        its parametrizations are run on stand-ins of their originals, which computes nothing."""
        plist = module.parametrizations[name]
        inside = {id(m) for m in plist.modules()}
        tensors = [t for t in self.tensors if any(id(m) in inside for m, _ in t.locations())]
        capture = Capture()
        standins = {id(t): capture.standin(t.global_shape, t.dtype, t.fqn) for t in tensors}
        try:
            with Installed(tensors, standins, capture, [(plist, "")]):
                with capture.active(f"{type(module).__name__}.{name}", "parametrization"):
                    value = getattr(module, name)
        except Exception as exc:
            kinds = ", ".join(type(p).__name__ for p in plist)
            raise PlanError(f"{type(module).__name__}.{name} is parametrized ({kinds}) and its parametrization does "
                            f"not run on stand-ins of its originals ({type(exc).__name__}: {exc}); give rules for "
                            f"its parametrizations.{name}.original* and buffers instead") from exc
        return tuple(value.shape), value.dtype

    # ------------------------------------------------------------------ declarative rules
    def resolve_rules(self) -> None:
        type_rules = {k: v for k, v in self.rules.items() if isinstance(k, type)}
        pattern_rules = [(k, v) for k, v in self.rules.items() if isinstance(k, str)]
        bad = [k for k in self.rules if not isinstance(k, (str, type))]
        if bad:
            raise PlanError(f"rules keys must be FQN glob strings or nn.Module types, got {bad!r}")
        for pattern, initializer in pattern_rules + list(self.registry.patterns):
            if not callable(initializer):
                raise PlanError(f"the rule for FQN pattern {pattern!r} is not callable: {initializer!r}")
            problem = initializer_problem(initializer)
            if problem is not None:
                raise PlanError(f"the rule for FQN pattern {pattern!r}: {problem}")
        for module_type, rule in type_rules.items():
            if not callable(rule):
                raise PlanError(f"the rule for {module_type.__name__} is not callable: {rule!r}")
        patterns = pattern_rules + list(self.registry.patterns)
        self.modules: dict[int, tuple[torch.nn.Module, str]] = {}
        for _raw, canonical, module in canonical_modules(self.model):
            self.modules.setdefault(id(module), (module, canonical))

        matched: set[str] = set()
        for t in self.tensors:
            for pattern, initializer in patterns:
                if any(fnmatch.fnmatchcase(name, pattern) for name in t.names):
                    matched.add(pattern)  # matched, even where an earlier pattern wins
                    if t.rule is None:
                        t.rule = ("pattern", f"pattern {pattern}", initializer)
        unmatched = [p for p, _ in pattern_rules if p not in matched]
        if unmatched and self.strict:
            raise PlanError(f"FQN rules matched no tensor of this model: {unmatched}; pass strict=False to allow")

        named = [(t.fqn, t.tensor) for t in self.tensors]
        self._storages = storages_of(named)  # module rules may write none of them
        with model_kept(self.model, named, "a module rule"):
            self._apply_module_rules(type_rules)

    def _apply_module_rules(self, type_rules: Mapping[type, ModuleRule]) -> None:
        for module, module_fqn in self.modules.values():
            if not self._own(module):
                continue
            default = _default_rule(module)
            if default is not None:
                self._apply_module_rule(module, module_fqn, default[1], "default", f"default {default[0].__name__}")
                for t in self._own(module).values():  # no torch.nn default over a constructor's record
                    if t.record is not None and t.rule is not None and t.rule[0] == "default":
                        t.rule = None
            user = next(((cls, type_rules[cls]) for cls in type(module).__mro__ if cls in type_rules), None)
            user = user or self.registry.module_rule(type(module))
            if user is not None:
                self._apply_module_rule(module, module_fqn, user[1], "rule", f"rule {user[0].__name__}")
            self._parametrized_records(module, module_fqn)

    def _parametrized_records(self, module: torch.nn.Module, module_fqn: str) -> None:
        """A tensor parametrized after construction (``weight_norm`` on a deferred model) starts from
        its constructor's record, through ``right_inverse``; only a module rule or pattern beats it."""
        record = record_of(module)
        if record is None:
            return
        for name in parametrized_names(module):
            node = record.value(name)
            if node is None or (isinstance(node, Read) and isinstance(node.version, Alloc)):
                continue
            current = self.parametrized.get((id(module), name))
            if current is not None and current[3] != "default":
                continue
            shape, _dtype = self._parametrized_value(module, name)
            if tuple(node.shape) != shape:
                continue
            self.parametrized[(id(module), name)] = (module, module_fqn, name, "constructor", "constructor", node)
            self.constructed.add(id(module))

    def _apply_module_rule(self, module: torch.nn.Module, module_fqn: str, rule: ModuleRule, kind: str,
                           label: str) -> None:
        own = self._own(module)
        where = module_fqn or "<root>"
        try:
            context = self._context(module, module_fqn)
            with no_writes([module], [(t.fqn, t.tensor) for t in own.values()], f"{label} for {where}",
                           self._storages):
                produced = rule(module, context)
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(f"{label} raised while planning {where}: {exc!r}") from exc
        if not isinstance(produced, Mapping):
            raise PlanError(f"{label} for {where} must return a mapping of tensor name to initializer, "
                            f"got {type(produced).__name__}")
        for name, initializer in produced.items():
            if name not in own and name in parametrized_names(module):
                if not callable(initializer):
                    raise PlanError(f"{label} for {where}.{name}: {initializer!r} is not an initializer")
                if kind == "default" and self._originals_recorded(module, name):
                    continue  # parametrized in the constructor: its originals' record is replayed as is
                current = self.parametrized.get((id(module), name))
                if current is None or current[3] == "default":
                    self.parametrized[(id(module), name)] = (module, module_fqn, name, kind, label, initializer)
                continue
            if name not in own:
                raise PlanError(f"{label} for {where} returned {name!r}, which is not a parameter or buffer "
                                f"of it (it has {sorted(own)})")
            problem = initializer_problem(initializer)
            if problem is not None:
                raise PlanError(f"{label} for {own[name].fqn}: {problem}", (own[name].fqn,))
            t = own[name]
            if kind == "default" and t.module is not module:
                # torch.nn's default reaches a tensor only through the module that owns it (its first
                # name): an alias (``decoder.bias = self.bias``, HF's tied heads) was assigned after the
                # aliasing module's constructor ran its reset_parameters, so eager torch never applied it
                continue
            if t.rule is not None and (t.rule[0] == "pattern" or t.module is not module):
                continue  # a pattern wins; a tied tensor follows its first name's module
            t.rule = (kind, label, initializer)

    # ------------------------------------------------------------------ init code
    def code_calls(self) -> list[tuple[torch.nn.Module, str, str, Callable[[], Any]]]:
        """``(module, module_fqn, label, call)`` for the init code to capture, in order."""
        calls: list[tuple[torch.nn.Module, str, str, Callable[[], Any]]] = []
        # 0. rules for parametrized tensors, written into the originals through right_inverse
        for module, module_fqn, name, _kind, label, initializer in self.parametrized.values():
            shape, dtype = self._parametrized_value(module, name)
            calls.append((module, module_fqn, label,
                          through_right_inverse(module, module_fqn, name, shape, dtype, initializer)))
        parents = {id(child): parent for parent, _ in self.modules.values() for child in parent.children()}
        for module, module_fqn in self.modules.values():
            uncovered = [t for t in self._own(module).values() if t.rule is None and t.module is module]
            if id(module) in self.constructed:
                continue  # its constructor's state is in the record
            start = parametrization_start(module, parents.get(id(module)))
            if uncovered and start is not None:
                calls.append((module, module_fqn, f"{type(module).__name__} start", start))
        # 1. reset_parameters of modules with tensors no declarative rule covers
        for module, module_fqn in self.modules.values():
            uncovered = [t for t in self._own(module).values() if t.rule is None and t.module is module]
            if id(module) in self.constructed:
                continue  # the constructor's reset_parameters calls are in the record
            if uncovered and callable(getattr(module, "reset_parameters", None)):
                calls.append((module, module_fqn, "reset_parameters", module.reset_parameters))
        # built-in init code spanning a module's descendants (nn.Transformer's xavier re-init)
        from keyinit.nn_defaults import DEFAULT_INIT_CODE

        for module, module_fqn in self.modules.values():
            code = DEFAULT_INIT_CODE.get(type(module))
            if code is not None and id(module) not in self.constructed:
                calls.append((module, module_fqn, f"default {type(module).__name__}", bind_call(code, {}, module)))
        # 2. the user's init method
        method = self.init_method
        kwargs = self.init_kwargs
        if method is None:
            if kwargs:
                raise PlanError("init_kwargs given without an init_method")
            return calls
        if isinstance(method, str):
            roots = []
            covered: set[int] = set()
            for _raw, canonical, module in canonical_modules(self.model):
                if id(module) in covered or not callable(getattr(module, method, None)):
                    continue
                roots.append((module, canonical))
                covered.update(id(sub) for sub in module.modules())
            if not roots and self.strict:
                raise PlanError(f"init_method {method!r}: no module of this model has that method")
            for module, canonical in roots:
                bound = getattr(module, method)
                if takes_module(bound):  # e.g. "_init_weights": applied to every module of its subtree
                    calls += self._per_module(module, canonical, bound, method, kwargs)
                else:
                    calls.append((module, canonical, method, bind_call(bound, kwargs)))
            return calls
        if callable(method):
            label = getattr(method, "__name__", "init_method")
            if takes_module(method):
                return calls + self._per_module(self.model, "", method, label, kwargs)
            return calls + [(self.model, "", label, bind_call(method, kwargs))]
        raise PlanError(f"init_method must be a method name or a callable, got {method!r}")

    def _per_module(self, root: torch.nn.Module, root_fqn: str, fn: Callable[..., Any], label: str,
                    kwargs: Mapping[str, Any]) -> list[tuple[torch.nn.Module, str, str, Callable[[], Any]]]:
        """``fn(module)`` for every module under ``root``, children before parents (as HF's
        ``smart_apply``). A descendant with its own method of the same name (an HF sub-model)
        has its subtree initialized by that method instead; under an HF ``PreTrainedModel``,
        only a descendant that is itself a ``PreTrainedModel`` switches, as HF does."""
        name = getattr(fn, "__name__", None)
        owner = getattr(fn, "__self__", None)
        hf_owner = _is_hf_pretrained(owner)
        calls: list[tuple[torch.nn.Module, str, str, Callable[[], Any]]] = []
        seen: set[int] = set()

        def visit(module: torch.nn.Module, fqn: str, current: Callable[..., Any]) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            for child_name, child in module._modules.items():
                if child is None:
                    continue
                child_name_fqn = child_fqn(module, fqn, child_name)
                own = getattr(child, name, None) if (name and isinstance(owner, torch.nn.Module)) else None
                if hf_owner and not _is_hf_pretrained(child):
                    own = None  # HF's smart_apply switches only at PreTrainedModel sub-models
                nxt = own if (own is not None and getattr(own, "__self__", None) is child) else current
                visit(child, child_name_fqn, nxt)
            calls.append((module, fqn, label, PerModuleCall(current, kwargs, module)))

        visit(root, root_fqn, fn)
        return calls

    def _hf_tie_sources(self) -> Optional[dict[int, tuple[torch.nn.Module, str]]]:
        """For an HF ``PreTrainedModel``: ``id(tensor) -> (module, attr)`` of the tie source of every
        tensor its ``tie_weights`` ties (``all_tied_weights_keys``, target -> source, raw FQNs);
        ``None`` for any other model."""
        if not _is_hf_pretrained(self.model):
            return None
        mapping = getattr(self.model, "all_tied_weights_keys", None)
        if not isinstance(mapping, Mapping):
            return {}
        where: dict[str, tuple[torch.nn.Module, str]] = {}
        for name, module in self.model.named_modules(remove_duplicate=False):
            for table in (module._parameters, module._buffers):
                for attr in table:
                    where[f"{name}.{attr}" if name else attr] = (module, attr)
        by_location = {(id(m), a): t for t in self.tensors for m, a in t.locations()}
        owners: dict[int, tuple[torch.nn.Module, str]] = {}
        for target, source in mapping.items():
            if not isinstance(target, str) or not isinstance(source, str) or source not in where \
                    or target not in where:
                continue
            t = by_location.get((id(where[source][0]), where[source][1]))
            if t is not None and t is by_location.get((id(where[target][0]), where[target][1])):
                owners[id(t)] = where[source]
        return owners

    def capture(self, materializing: bool) -> None:
        """Run the init code on stand-ins and give every tensor its program."""
        calls = self.code_calls()
        declared = {}
        for t in self.tensors:
            if t.rule is not None:
                declared[id(t)] = _initializer_program(t.fqn, t.global_shape, t.dtype, t.rule[1], t.rule[2])
        if not calls and not any(t.record is not None for t in self.tensors):
            for t in self.tensors:
                t.program = declared.get(id(t))
                t.origin = t.rule[0] if t.rule is not None else "kept"
            return
        capture = Capture()
        try:
            self._capture_code(capture, calls, declared)
        except BaseException:
            forget_escaped(capture)  # no stand-in left in an lru_cache for later eager code
            raise
        # what the init code left outside the model (an lru_cache helper's table) gets its real values
        sweep_escaped(capture, {}, "init code")

    def _capture_code(self, capture: Capture, calls: list, declared: dict[int, SlotProgram]) -> None:
        """:meth:`capture` with its stand-ins (dropped when this returns: what is still alive escaped)."""
        standins: dict[int, LazyTensor] = {}
        for t in self.tensors:
            replayed = t.record is not None and (t.rule is None or t.rule[0] == "default")
            # a record is replayed in the constructor's dtype and rounded to the tensor's as it is written
            stand = capture.standin(t.global_shape, t.record.dtype if replayed else t.dtype, t.fqn)
            if replayed:
                seed_storage(capture.storage_of(stand), t.record, "constructor")
            elif t.rule is not None and t.rule[0] == "default":  # the default is the base the code writes on
                program = declared[id(t)]
                capture.storage_of(stand).write(StridedView.contiguous(t.global_shape), program.writes[0].value,
                                                t.rule[1])
            standins[id(t)] = stand
        failures = []
        owners = self._hf_tie_sources()
        installed = Installed(self.tensors, standins, capture, list(self.modules.values()))
        with installed:
            for module, fqn, label, call in calls:
                site = f"{type(module).__name__} at {fqn or '<root>'}"
                try:
                    with capture.active(site, label), installed.untied(module if getattr(call, "untie", False)
                                                                          else None, capture, owners):
                        call()
                except (UnkeyedRandomnessError, CaptureError, Exception) as exc:  # noqa: B014 - kept explicit
                    failures.append((module, fqn, site, label, exc))
            reassigned = installed.reassigned()
        for t in self.tensors:
            if t.rule is not None and t.rule[0] in ("rule", "pattern"):
                t.program, t.origin = declared[id(t)], t.rule[0]
                continue
            new = reassigned.get(id(t))
            if new is not None:
                t.origin = "code"
                t.program = SlotProgram(t.fqn, tuple(new.shape), new.dtype, (), capture.node(new), True)
                if tuple(new.shape) != t.global_shape or new.dtype != t.dtype:
                    t.recreated = True
                    t.global_shape, t.dtype = tuple(new.shape), new.dtype
                continue
            program = SlotProgram.of_storage(t.fqn, t.global_shape, capture.storage_of(standins[id(t)]))
            t.program = None if program.empty else program
            if program.empty and id(capture.storage_of(standins[id(t)])) in capture.emptied:
                self.emptied[t.fqn] = capture.emptied[id(capture.storage_of(standins[id(t)]))]
            only_default = t.rule is not None and len(program.writes) == 1 and program.source == t.rule[1]
            if program.empty:
                t.origin = "kept"
            elif t.record is not None and program.source == "constructor":
                t.origin = "constructor"
            else:
                t.origin = "default" if only_default else "code"
        for module, module_fqn, name, kind, value in installed.assigned():
            fqn = apply_fqn_mapping(f"{module_fqn}.{name}" if module_fqn else name, self.fqn_prefix, self.fqn_map)
            entry = PlannedTensor(fqn, [fqn], fqn, kind, module, module_fqn, name, origin="code", new=True,
                                  global_shape=tuple(value.shape), dtype=value.dtype)
            entry.program = SlotProgram(fqn, tuple(value.shape), value.dtype, (), capture.node(value), True)
            self.tensors.append(entry)
        self._check_failures(failures)

    def _check_failures(self, failures: list) -> None:
        """Init code that failed is an error unless a rule covers every tensor it could write."""
        for module, fqn, site, label, exc in failures:
            subtree = {id(sub) for sub in module.modules()}
            exposed = [t.fqn for t in self.tensors
                       if any(id(m) in subtree for m, _ in t.locations())
                       and not (t.rule is not None and t.rule[0] in ("rule", "pattern"))]
            if not exposed:
                self.notes.append(f"{label} of {site} failed ({exc}); every tensor it could write has a rule")
                continue
            if isinstance(exc, UnkeyedRandomnessError):
                raise exc
            raise PlanError(f"{site}: {label} failed while keyinit captured it on global-shape stand-ins: "
                            f"{type(exc).__name__}: {exc}", tuple(exposed)) from exc


def plan_model(model: torch.nn.Module, seed: Union[int, Key], options: InitOptions = InitOptions(), *,
               materializing: bool = False) -> ModelPlan:
    """Plan every tensor of ``model`` (see the module docstring) with :func:`keyinit.init_model`'s ``options``.

    ``materializing``: every buffer must be covered too (``materialize`` has no old values to keep).
    Nothing is allocated or written; the model is left exactly as it was.
    """
    check_lazy(model, "cannot plan the model")
    planner = _Planner(model, seed, options)
    planner.collect()
    planner.resolve_rules()
    planner.capture(materializing)
    check_plan(planner.tensors, materializing=materializing, emptied=planner.emptied, model=model,
               init_method=options.init_method, stream=planner.root_key.stream)
    note = unused_init_code_note(model, planner.tensors, options.init_method)
    if note is not None:
        planner.notes.append(note)
    warn_shared_draws(planner.tensors)
    return ModelPlan(model, planner.root_key, planner.seed, planner.tensors, planner.shards, planner.notes)
