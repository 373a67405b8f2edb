"""Draws that land in several model tensors: the one case where a pipeline stage cannot know a key.

Spec section 15 keys a draw several model tensors depend on by the first of them in model
order. A stage that does not hold that first tensor sees the draw land only in its own
tensors and keys it by them, so its values differ from the full model's. No stage can tell
(it does not see the tensors it lacks), so the full model warns when it plans such a draw
across tensors a pipeline cut can separate: tensors in different items of a module list
(``layers.3`` / ``layers.4``) or in different modules outside any list
(``tok_embeddings`` / ``output``). Draws shared within one list item (a fused q/k/v
temporary copied into ``wq``, ``wk``, ``wv``) stay on one stage and are not reported.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from keyinit.errors import SharedDrawWarning

__all__ = ["SharedDrawWarning", "stage_unit", "shared_draws", "warn_shared_draws"]


def stage_unit(module_fqn: str) -> str:
    """The part of a module's FQN a pipeline cut keeps together: up to its first list index, or all of it."""
    parts = module_fqn.split(".") if module_fqn else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module_fqn


def shared_draws(tensors: Sequence[Any]) -> list[tuple[str, list[str]]]:
    """``(first fqn, [every fqn])`` for each draw landing in tensors of different stage units and keys.

    ``tensors`` are planned tensors (``fqn``, ``key_fqn``, ``module_fqn``, ``program``) in model order.
    """
    from keyinit._engine.programs.program import random_nodes

    landing: dict[int, list[Any]] = {}
    for t in tensors:
        if t.program is None:
            continue
        for draw in random_nodes(t.program):
            landing.setdefault(id(draw), []).append(t)
    found = []
    for ts in landing.values():
        keys = {t.key_fqn for t in ts}
        units = {stage_unit(t.module_fqn) for t in ts}
        if len(keys) > 1 and len(units) > 1:
            found.append((ts[0].fqn, [t.fqn for t in ts]))
    return found


def warn_shared_draws(tensors: Sequence[Any]) -> None:
    """One :class:`SharedDrawWarning` per such draw, naming the tensors."""
    for first, names in shared_draws(tensors):
        warnings.warn(
            f"keyinit: init code draws one random tensor that lands in {names}; it is keyed by {first!r}, the "
            f"first of them, and a pipeline stage that holds the others but not {first!r} gets different values "
            f"for them. Draw each tensor's values separately, or keep these tensors on one stage.",
            SharedDrawWarning,
            stacklevel=4,
        )
