"""Keyed values of a random ATen op run inside a keyed forward: per sample, or replicated.

The op's distribution and transform are those of captured init code
(:func:`keyinit._engine.random_ops.keyed_effects`, ``docs/spec.md`` section 15); only
the stream positions differ (``docs/spec.md`` section 14.6):

- **replicated** (the output holds no batch): the output's row-major index, as
  for a tensor of the output's shape;
- **per sample** (the output's batch is known, :mod:`keyinit.nn._batch`): the
  element's row-major index in the tensor ``(start + count, *sample_shape)``
  whose row ``s`` is global sample ``s``, so each element's value depends only on
  its sample and its place within it (:func:`keyinit.nn._batch.canonical`).

Ops whose output is one joint draw over its rows (``randperm``, ``multinomial``
without a per-row input) cannot be split by sample: on a per-sample output they
are refused.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from keyinit.errors import UnkeyedRandomnessError
from keyinit.keys import Key, fold_in
from keyinit.nn._batch import Batch, canonical

__all__ = ["keyed_draw"]


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Generator):
        return None
    return x


def _evaluator(keys: dict, batch: Optional[Batch]) -> Any:
    from keyinit._engine.replay import Evaluator, run_fill
    from keyinit._engine.program import Random
    from keyinit.layouts import Target
    from keyinit.regions import make_region

    if batch is None:
        return Evaluator(keys, why_unkeyed="needs a random value keyinit cannot key")

    start, count = batch.start, batch.count

    class _Rows(Evaluator):
        """Random nodes of shape ``(count, ...)`` read at rows ``start ...`` of a tensor of samples."""

        def _check(self, node: Any) -> int:
            if not node.shape or node.shape[0] != count or not node.by_index:
                raise UnkeyedRandomnessError(
                    f"{node.site}: {node.what} is one joint draw over the whole local batch (shape "
                    f"{tuple(node.shape)}), so its values would depend on how the batch is split; keyinit keys "
                    "only draws made per sample or replicated ones"
                )
            return node.numel // count if count else 0

        def _full(self, node: Any) -> torch.Tensor:
            if not isinstance(node, Random):
                return super()._full(node)
            self._check(node)
            out = torch.empty(node.shape, dtype=node.dtype)
            shape = (start + count,) + tuple(node.shape[1:])
            region = (slice(start, None),) + (slice(None),) * (len(shape) - 1)
            run_fill(node.fill, self.key(node), Target(node.what, make_region(shape, region), out))
            return out

        def _random_at(self, node: Any, pos: torch.Tensor) -> torch.Tensor:
            per = self._check(node)
            out = torch.empty(int(pos.numel()), dtype=node.dtype)
            total = max((start + count) * per, 1)
            run_fill(node.fill, self.key(node), Target(node.what, make_region((total,), (pos + start * per,)), out))
            return out

    return _Rows(keys, why_unkeyed="needs a random value keyinit cannot key")


def keyed_draw(func: Any, args: tuple, kwargs: dict, key: Key, batch: Optional[Batch], site: str) -> Any:
    """``func(*args, **kwargs)`` (a random ATen op) with keyinit's values for ``key``; ``batch`` is the
    output's batch (None: replicated). In-place ops write their argument and return it."""
    from keyinit._engine.program import Literal, Node, Random
    from keyinit._engine.random_ops import bind_arguments, keyed_effects

    meta_out = func(*[_meta(a) for a in args], **{k: (torch.device("meta") if k == "device" else _meta(v))
                                                    for k, v in kwargs.items()})
    outputs = [t for t in tree_flatten(meta_out)[0] if isinstance(t, torch.Tensor)]
    shape = tuple(outputs[0].shape) if outputs else ()
    if batch is not None and func._schema.name == "aten::randperm":
        raise UnkeyedRandomnessError(
            f"{site}: randperm({shape[0] if shape else 0}) sized by the batch is one joint draw over the whole "
            "local batch (a pairing or shuffle of its rows), so its values would depend on how the batch is split; "
            "keyinit keys only draws made per sample or replicated ones (draw per-sample keys, e.g. "
            "torch.rand(x.shape[0]), and argsort them, or shuffle outside the keyed forward)"
        )
    if batch is not None:
        split, order, sample_shape = canonical(shape, batch)
        local = (batch.count,) + sample_shape
        inverse = [order.index(i) for i in range(len(order))]

        def to_canonical(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(split).permute(order).reshape(local)

        def from_canonical(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(tuple(split[i] for i in order)).permute(inverse).reshape(shape)
    else:
        def to_canonical(t: torch.Tensor) -> torch.Tensor:
            return t

        from_canonical = to_canonical
        local = shape

    def read(t: torch.Tensor) -> Node:
        if t.dim() == 0:
            return Literal(t.detach().cpu())
        if tuple(t.shape) != shape:
            raise UnkeyedRandomnessError(
                f"{site}: {func} takes a {tuple(t.shape)} tensor argument for a {shape} output; keyinit keys "
                "such a draw only when the argument has the output's shape or is a scalar"
            )
        return Literal(to_canonical(t.detach()).cpu())

    metas = [o if batch is None or o.dim() == 0 or tuple(o.shape) != shape else
             torch.empty(local, dtype=o.dtype, device="meta") for o in outputs]
    effects = keyed_effects(func, args, kwargs, metas, site, read, caller="the keyed forward")
    draws: list = []
    seen: set[int] = set()

    def visit(node: Node) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, Random):
            draws.append(node)
        for child in getattr(node, "inputs", ()):
            visit(child)

    for node in [n for n in effects.returns if n is not None] + [n for _, n in effects.writes]:
        visit(node)
    evaluator = _evaluator({draw: fold_in(key, j) for j, draw in enumerate(draws)}, batch)
    bound = bind_arguments(func, args, kwargs)
    device = kwargs.get("device") or next(
        (a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)), torch.device("cpu"))

    def value(node: Node, like: torch.Tensor) -> torch.Tensor:
        full = evaluator.full(node)
        if batch is not None and tuple(like.shape) == shape and like.dim():
            full = from_canonical(full)
        return full.to(device).reshape(like.shape)

    with torch.no_grad():
        for name, node in effects.writes:
            target = bound[name]
            target.copy_(value(node, target))
    results = []
    for node, meta in zip(effects.returns, outputs):
        results.append(bound.get("self", bound.get("out")) if node is None else value(node, meta))
    if isinstance(meta_out, torch.Tensor):
        return results[0]
    return tuple(results)
