"""The init options: one frozen value that carries them from the public calls to the planner, the CLI and verify.

:func:`keyinit.init_model` and :func:`keyinit.materialize` spell the options out in their signatures
(the documentation a user reads); everything after them passes one :class:`InitOptions`. Adding an
option is a field here and a parameter in those two signatures, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import attrs

from keyinit.fqn import FqnMap
from keyinit.keys import DEFAULT_STREAM
from keyinit.rules import REGISTRY, Registry

__all__ = ["InitOptions", "InitMethod", "Rules"]

InitMethod = Union[str, Callable[..., Any], None]
Rules = Optional[Mapping[Union[str, type], Any]]


@attrs.frozen
class InitOptions:
    """:func:`keyinit.init_model`'s options (documented there), as given."""

    rules: Rules = None
    init_method: InitMethod = None
    init_kwargs: Optional[Mapping[str, Any]] = None
    ties: Optional[Mapping[str, str]] = None
    fqn_prefix: Optional[str] = None
    fqn_map: Optional[FqnMap] = None
    shards: Optional[Mapping[str, Any]] = None
    strict: bool = True
    stream: str = DEFAULT_STREAM
    registry: Registry = REGISTRY

    @classmethod
    def names(cls) -> frozenset[str]:
        """The option names (``init_model``'s keyword arguments but ``progress`` and ``device``)."""
        return frozenset(field.name for field in attrs.fields(cls))

    @classmethod
    def of(cls, kwargs: Mapping[str, Any], caller: str) -> InitOptions:
        """The options in ``kwargs``; a name that is no option is a ``TypeError`` naming ``caller``."""
        unknown = set(kwargs) - cls.names()
        if unknown:
            raise TypeError(f"{caller} got unexpected keyword arguments {sorted(unknown)}")
        return cls(**kwargs)

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> InitOptions:
        """The options among a public call's ``locals()`` (its other arguments are left out)."""
        return cls(**{name: arguments[name] for name in cls.names()})

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of :func:`keyinit.plan_init`."""
        return attrs.asdict(self, recurse=False)
