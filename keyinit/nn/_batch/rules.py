"""The one table of keyed()'s batching rules: which rule carries the batch through each ATen op.

A rule, ``rule(func, args, kwargs, outs, records) -> the records of outs``, says which
sample each element of an op's outputs belongs to (:mod:`keyinit.nn._batch.records`); it is
written in the file of its op family and named there, once, in that file's ``RULES``
entries ``(rule, op names)``:

- :mod:`keyinit.nn._batch.rules_tensor`: views, reshapes, transposes, slicing,
  ``cat``/``split``, matmuls, reductions, ops along one dimension, padding and flips,
  and the element-wise ops torch does not tag ``pointwise``;
- :mod:`keyinit.nn._batch.rules_nn`: convolutions, norms, pooling, fused attention,
  ``stack``, advanced indexing, the ops that write by index, FFTs, ``as_strided``.

:func:`build` makes the table from the families, refusing an op named twice (a second
rule would otherwise win or lose by the order of a dict). :func:`rule_for` looks an op
up by its overload packet name (``aten::view``); an op without an entry falls back to
the pointwise rule when torch tags it ``pointwise`` (or it is a Scalar form of
``where``), and otherwise has no rule: outputs of unknown batch
(:func:`keyinit.nn._batch.propagate.propagate`). Rows picked by index values have their own
rules first (:func:`keyinit.nn._batch.routed.routed_rule`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from keyinit.nn._batch import rules_nn, rules_tensor
from keyinit.nn._batch.rules_tensor import pointwise

__all__ = ["register", "build", "rule_for", "names"]

Entries = Iterable[tuple[Callable, Sequence[str]]]


def _named(rule: Callable) -> str:
    return f"{getattr(rule, '__module__', '?')}.{getattr(rule, '__qualname__', repr(rule))}"


def register(table: dict[str, Callable], op_name: str, rule: Callable) -> None:
    """Enter ``rule`` as the rule of the op whose overload packet is ``op_name`` (``"aten::view"``);
    a second rule for the same op is refused."""
    if op_name in table:
        raise ValueError(f"batch rules: {op_name} is given two rules, {_named(table[op_name])} and {_named(rule)}; "
                         "an op has one rule, in one family's RULES")
    table[op_name] = rule


def build(*families: Entries) -> dict[str, Callable]:
    """The table of ``families``' entries ``(rule, op names)``, each op named once in all of them."""
    table: dict[str, Callable] = {}
    for entries in families:
        for rule, op_names in entries:
            for op_name in op_names:
                register(table, op_name, rule)
    return table


_TABLE = build(rules_tensor.RULES, rules_nn.RULES)


def names() -> frozenset[str]:
    """The op names the table holds a rule for."""
    return frozenset(_TABLE)


def rule_for(func: Any) -> Optional[Callable]:
    """The rule of ATen op ``func`` (None: it has none)."""
    name = func._schema.name
    rule = _TABLE.get(name)
    if rule is not None:
        return rule
    if name == "aten::where" and func._overloadname != "default":
        return pointwise  # where(condition, self, other) with a Scalar: the pointwise forms not tagged so
    if torch.Tag.pointwise in func.tags:
        return pointwise
    return None
