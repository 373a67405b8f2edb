"""keyinit: layout-invariant, communication-free weight initialization.

Every element of every parameter is a pure function of (seed, the parameter's
canonical FQN, the element's global index), through stateless Philox4x32-10
keys. See ``docs/spec.md`` for the stream contract.
"""

from keyinit import random
from keyinit.keys import DEFAULT_STREAM, STREAM_VERSIONS, Key, fold_in, key, key_for, split

__version__ = "0.1.0"

__all__ = [
    "Key",
    "key",
    "split",
    "fold_in",
    "key_for",
    "random",
    "STREAM_VERSIONS",
    "DEFAULT_STREAM",
    "__version__",
]
