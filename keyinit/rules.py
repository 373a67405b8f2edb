"""Rules: which initializer each parameter and buffer gets.

A *module rule* is a function ``rule(module, ctx) -> Mapping[str, Initializer]``
from a module's local tensor names (``"weight"``, ``"bias"``) to initializers.
It must not write anything: init_model first plans every tensor, validates the
plan, and only then writes. ``ctx`` gives the GLOBAL shapes, so fans never
depend on how a tensor is sharded.

An *FQN rule* maps a glob pattern over canonical FQNs (``fnmatch`` syntax, where
``*`` also matches dots) to an initializer.

Precedence, highest first: FQN rules passed to ``init_model(rules=...)``, FQN
rules registered with :func:`register_pattern` (later registrations first), module rules for
the module's exact type, then its base classes in MRO order (registered rules
before the built-in torch.nn defaults), then the fallback (the module's own
``reset_parameters``/``init_weights`` run with keying in effect).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import attrs
import torch

from keyinit.init import Initializer

__all__ = ["RuleContext", "ModuleRule"]


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
