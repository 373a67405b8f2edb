"""keyinit: layout-invariant, communication-free weight initialization.

Every element of every parameter is a pure function of (seed, the parameter's
canonical FQN, the element's global index), through stateless Philox4x32-10
keys. See ``docs/spec.md`` for the stream contract and ``docs/`` for the guide.
"""

from keyinit import init, layouts, random
from keyinit.keys import DEFAULT_STREAM, Key, fold_in, key, key_for, split
from keyinit._engine.deferred.deferred import deferred
from keyinit._engine.planning.init_code import call_once, per_module
from keyinit.model import InitReport, Plan, TensorRecord, init_model, materialize, plan_init
from keyinit.rules import REGISTRY, Registry, RuleContext, register, register_pattern
from keyinit.errors import InitError, LeftPaddingWarning, PlanError, SharedDrawWarning, UnkeyedRandomnessError
from keyinit import nn
from keyinit import optim
from keyinit import _kernels

_kernels.register()  # stream v1's kernels into the dispatch table: names only, nothing built or imported

__version__ = "0.1.0"


def __getattr__(name: str):
    """``keyinit.data`` is imported on first use (it pulls in torch.utils.data); ``STREAM_VERSIONS`` is read
    from the stream registry at each access."""
    if name == "data":
        import importlib

        return importlib.import_module("keyinit.data")
    if name == "STREAM_VERSIONS":
        from keyinit import keys

        return keys.STREAM_VERSIONS
    raise AttributeError(f"module 'keyinit' has no attribute {name!r}")

__all__ = [
    "Key",
    "key",
    "split",
    "fold_in",
    "key_for",
    "random",
    "init",
    "layouts",
    "nn",
    "optim",
    "data",
    "deferred",
    "per_module",
    "call_once",
    "init_model",
    "materialize",
    "plan_init",
    "Plan",
    "InitReport",
    "TensorRecord",
    "InitError",
    "PlanError",
    "UnkeyedRandomnessError",
    "SharedDrawWarning",
    "LeftPaddingWarning",
    "register",
    "register_pattern",
    "Registry",
    "REGISTRY",
    "RuleContext",
    "STREAM_VERSIONS",
    "DEFAULT_STREAM",
    "__version__",
]
