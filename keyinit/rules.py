"""Rules: which initializer each parameter and buffer gets.

A *module rule* is a function ``rule(module, ctx) -> Mapping[str, Initializer]``
from a module's local tensor names (``"weight"``, ``"bias"``) to initializers.
It must not write anything: init_model first plans every tensor, validates the
plan, and only then writes. ``ctx`` gives the GLOBAL shapes, so fans never
depend on how a tensor is sharded.

An *FQN rule* maps a glob pattern over canonical FQNs (``fnmatch`` syntax, where
``*`` also matches dots) to an initializer.

Precedence, highest first: FQN rules passed to ``init_model(rules=...)``, FQN
rules registered with :func:`register_pattern` (later registrations first),
module rules passed to ``init_model(rules=...)`` (the module's exact type, then
its base classes in MRO order), registered module rules (likewise; a passed
rule for a base class beats a registered one for the exact type), then init code (the ``init_method``, then the
module's own ``reset_parameters``: captured and replayed keyed, see
:mod:`keyinit._engine.planning.plan`), then the built-in torch.nn defaults, which init code
writes on top of.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Callable

import attrs
import torch

from keyinit.init import Initializer

__all__ = ["RuleContext", "ModuleRule", "Registry", "REGISTRY", "register", "register_pattern"]


@attrs.frozen
class RuleContext:
    """What a module rule may know about the module it initializes.

    ``global_shapes`` maps each local tensor name of the module (direct
    parameters and buffers only) to its GLOBAL shape; ``fqn_prefix`` is the
    module's canonical FQN (``""`` for the root).
    """

    fqn_prefix: str
    global_shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]

    def global_shape(self, name: str) -> tuple[int, ...]:
        """The global shape of the module's tensor ``name``."""
        try:
            return self.global_shapes[name]
        except KeyError:
            raise KeyError(
                f"module {self.fqn_prefix or '<root>'} has no parameter or buffer {name!r}; "
                f"it has {sorted(self.global_shapes)}"
            ) from None

    def fqn(self, name: str) -> str:
        return f"{self.fqn_prefix}.{name}" if self.fqn_prefix else name


ModuleRule = Callable[[torch.nn.Module, RuleContext], Mapping[str, Initializer]]


def initializer_problem(init: object) -> "str | None":
    """Why ``init`` cannot serve as an initializer ``fn(key, target)``, or None if it can.

    Checked when a rule is registered or planned, so a wrong callable (``torch.nn.init.zeros_``,
    which takes a tensor) is refused before anything is written.
    """
    if isinstance(init, Initializer):
        return None
    if not callable(init):
        return f"{init!r} is not callable"
    if getattr(init, "__module__", None) == "torch.nn.init":
        name = getattr(init, "__name__", "?")
        return (f"torch.nn.init.{name} takes a tensor, not (key, target); use keyinit.init."
                f"{name.rstrip('_')}(...) or another keyinit.init initializer")
    try:
        signature = inspect.signature(init)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: trusted
    try:
        signature.bind(None, None)
    except TypeError:
        return f"{init!r} must be an initializer called as fn(key, target); its signature is {signature}"
    return None



class Registry:
    """The documented, process-wide table of user rules (``keyinit.REGISTRY``).

    Module rules are keyed by type and looked up along the module's MRO; FQN
    rules are glob patterns tried newest first. With the stream-version registry
    (``keyinit._bits.streams.STREAMS``) it is the only global mutable state in
    keyinit. Tests and libraries that need isolation pass their own
    ``Registry()`` to ``init_model(registry=...)``.
    """

    def __init__(self) -> None:
        self._module_rules: dict[type, ModuleRule] = {}
        self._patterns: list[tuple[str, Initializer]] = []

    def register(self, module_type: type, rule: "ModuleRule | None" = None):
        """Register ``rule`` for ``module_type``; usable as ``@registry.register(nn.Linear)``."""
        if not (isinstance(module_type, type) and issubclass(module_type, torch.nn.Module)):
            raise TypeError(f"register() takes an nn.Module subclass, got {module_type!r}")

        def add(fn: ModuleRule) -> ModuleRule:
            if not callable(fn):
                raise TypeError(f"the rule for {module_type.__name__} must be callable, got {fn!r}")
            self._module_rules[module_type] = fn
            return fn

        return add if rule is None else add(rule)

    def register_pattern(self, pattern: str, initializer: "Initializer | None" = None):
        """Register ``initializer`` for canonical FQNs matching the glob ``pattern``.

        Usable as ``@registry.register_pattern("layers.*.wq.weight")`` on a
        function ``fn(key, target)``, which then serves as the initializer.
        """
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"register_pattern() takes a non-empty glob str, got {pattern!r}")

        def add(init: Initializer) -> Initializer:
            problem = initializer_problem(init)
            if problem is not None:
                raise TypeError(f"the initializer for pattern {pattern!r}: {problem}")
            self._patterns.insert(0, (pattern, init))
            return init

        return add if initializer is None else add(initializer)

    def unregister(self, target: "type | str") -> None:
        """Remove the rule for a module type or every rule of a pattern."""
        if isinstance(target, str):
            self._patterns = [(p, i) for p, i in self._patterns if p != target]
        else:
            self._module_rules.pop(target, None)

    def module_rule(self, module_type: type) -> "tuple[type, ModuleRule] | None":
        for cls in module_type.__mro__:
            if cls in self._module_rules:
                return cls, self._module_rules[cls]
        return None

    @property
    def patterns(self) -> tuple[tuple[str, Initializer], ...]:
        return tuple(self._patterns)


#: The process-wide registry behind ``keyinit.register`` and ``keyinit.register_pattern``.
REGISTRY = Registry()
register = REGISTRY.register
register_pattern = REGISTRY.register_pattern
