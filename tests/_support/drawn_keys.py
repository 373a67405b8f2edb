"""``keys_drawn()``: the key of every draw of keyed forwards while it is open (for the sweeps and
benchmarks/survey_shared_keys.py, which check that no two draws of one forward share a key)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def keys_drawn() -> Iterator[list]:
    """``[(id(root forward), FQN, key)]``, one per draw, in order, while it is open."""
    from keyinit.nn._forward.pieces import Forward

    drawn: list = []
    original = Forward.call_key

    def call_key(self, ctx, fqn, ordinal):
        k = original(self, ctx, fqn, ordinal)
        drawn.append((id(self), fqn, k))
        return k

    Forward.call_key = call_key
    try:
        yield drawn
    finally:
        Forward.call_key = original
