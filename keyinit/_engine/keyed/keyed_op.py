"""One random ATen op answered with keyed values: what keyed samples, keyed collates and keyed forwards run.

:func:`keyed_op` computes ``func(*args, **kwargs)`` (an op :func:`keyinit._engine.programs.random_ops.is_random`
says draws) with keyinit's values instead of torch's generator: the op's keyed equivalent
(:func:`keyinit._engine.programs.random_ops.keyed_effects`, ``docs/spec.md`` section 15), its ``j``-th draw keyed
by ``fold_in(key, j)``, evaluated by the replay engine, written into the op's mutated arguments and
returned. Nothing reads or advances torch's generator.

By default a draw reads stream positions as the row-major index of the op's output (replicated). With
``rows`` (:class:`Rows`), the output's elements are first laid out as samples (``rows.to_canonical``:
``(count, *sample_shape)``) and a draw reads rows ``start ... start + count - 1`` of the tensor of
samples ``(start + count, *sample_shape)``: each value depends only on its sample and its place in it
(``docs/spec.md`` section 14.7). A draw that is one joint draw over all rows cannot be split so.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import attrs
import torch
from torch.utils._pytree import tree_flatten

from keyinit.errors import UnkeyedRandomnessError
from keyinit.keys import Key, fold_in

__all__ = ["Rows", "keyed_op"]


@attrs.frozen
class Rows:
    """The op's output as samples: ``to_canonical`` maps a tensor of the output's ``shape`` to
    ``(count, *sample_shape)`` (``local``) and ``from_canonical`` back; local sample 0 is ``start``; ``dim``
    is the dimension that holds the batch (None: every element one sample's)."""

    start: int
    count: int
    shape: tuple[int, ...]
    local: tuple[int, ...]
    to_canonical: Callable[[torch.Tensor], torch.Tensor]
    from_canonical: Callable[[torch.Tensor], torch.Tensor]
    dim: Optional[int] = None


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Generator):
        return None  # never used: the values are keyinit's
    return x


def _evaluator(keys: dict, rows: Optional[Rows]) -> Any:
    from keyinit._draw.names import naming
    from keyinit._engine.programs.program import Random
    from keyinit._engine.programs.replay import Evaluator, run_fill
    from keyinit.layouts import Target
    from keyinit.regions import make_region

    why = "needs a random value keyinit cannot key"
    if rows is None:
        return Evaluator(keys, why_unkeyed=why)
    start, count = rows.start, rows.count

    class _Rows(Evaluator):
        """Random nodes of shape ``(count, ...)`` read at rows ``start ...`` of a tensor of samples."""

        def _per_row(self, node: Any) -> int:
            if not node.shape or node.shape[0] != count or not node.by_index:
                raise UnkeyedRandomnessError(
                    f"{node.site}: {node.what} is one joint draw over the whole local batch (shape "
                    f"{tuple(node.shape)}), so its values would depend on how the batch is split; keyinit keys "
                    "only draws made per sample or replicated ones")
            return node.numel // count if count else 0

        def _full(self, node: Any) -> torch.Tensor:
            if not isinstance(node, Random):
                return super()._full(node)
            self._per_row(node)
            out = torch.empty(node.shape, dtype=node.dtype)
            shape = (start + count,) + tuple(node.shape[1:])
            region = (slice(start, None),) + (slice(None),) * (len(shape) - 1)
            with naming(node.shape[1:]):  # (a v2 key: the elements' extent-free names, docs/spec.md 14.8)
                run_fill(node.fill, self.key(node), Target(node.what, make_region(shape, region), out))
            return out

        def _random_at(self, node: Any, pos: torch.Tensor) -> torch.Tensor:
            per = self._per_row(node)
            out = torch.empty(int(pos.numel()), dtype=node.dtype)
            total = max((start + count) * per, 1)
            with naming(node.shape[1:]):
                run_fill(node.fill, self.key(node),
                         Target(node.what, make_region((total,), (pos + start * per,)), out))
            return out

    return _Rows(keys, why_unkeyed=why)


def keyed_op(func: Any, args: tuple, kwargs: dict, key: Key, site: str, caller: str,
             rows_of: Optional[Callable[[tuple[int, ...]], Rows]] = None) -> Any:
    """``func(*args, **kwargs)`` with keyinit's values for ``key`` (see the module docstring); ``site`` and
    ``caller`` name the code in errors; ``rows_of(shape)`` gives the :class:`Rows` of the op's output shape
    (None: replicated). In-place ops write their argument and return it."""
    from keyinit._engine.programs.program import Literal, Node, Random
    from keyinit._engine.programs.random_ops import bind_arguments, keyed_effects

    names = {arg.name for arg in func._schema.arguments}
    margs = tuple(_to_meta(a) for a in args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "device" in names:
        mkwargs["device"] = torch.device("meta")  # a factory: its shape without making (or drawing) anything
    try:
        meta_out = func(*margs, **mkwargs)
    except Exception as exc:  # noqa: BLE001 - no meta kernel or a data-dependent shape
        raise UnkeyedRandomnessError(f"{site}: cannot key {func} (its output shape is unknown without "
                                     f"running it: {exc})") from exc
    outputs = [t for t in tree_flatten(meta_out)[0] if isinstance(t, torch.Tensor)]
    rows = None if rows_of is None else rows_of(tuple(outputs[0].shape) if outputs else ())
    if rows is not None and func._schema.name == "aten::randperm":
        raise UnkeyedRandomnessError(
            f"{site}: randperm({rows.shape[0] if rows.shape else 0}) sized by the batch is one joint draw over the "
            "whole local batch (a pairing or shuffle of its rows), so its values would depend on how the batch is "
            "split; keyinit keys only draws made per sample or replicated ones (draw per-sample keys, e.g. "
            "torch.rand(x.shape[0]), and argsort them, or shuffle outside the keyed forward)")

    def laid_out(t: torch.Tensor) -> bool:  # a tensor keyed per sample: the output's shape
        return rows is not None and t.dim() > 0 and tuple(t.shape) == rows.shape

    def per_row(t: torch.Tensor) -> Optional[Node]:
        """``multinomial``'s ``(N, C)`` probabilities for an ``(N, k)`` output whose batch is in its rows: each
        output row draws from its own row, so the probabilities are laid out as the output's rows are, one
        row of ``C`` per output row of ``k`` (in each sample's order), and the draw is per sample."""
        if func._schema.name != "aten::multinomial" or t.dim() != 2 or len(rows.shape) != 2 or \
                rows.dim not in (0, None) or int(t.shape[0]) != rows.shape[0]:
            return None
        canonical = rows_of(tuple(t.shape)).to_canonical(t.detach())
        return Literal(canonical.reshape(-1, int(t.shape[1])).cpu())

    def read(t: torch.Tensor) -> Node:
        if rows is None or t.dim() == 0:
            return Literal(t.detach().cpu())
        found = None if laid_out(t) else per_row(t)
        if found is not None:
            return found
        if not laid_out(t):
            raise UnkeyedRandomnessError(
                f"{site}: {func} takes a {tuple(t.shape)} tensor argument for a {rows.shape} output; keyinit keys "
                "such a draw per sample only when the argument has the output's shape or is a scalar")
        return Literal(rows.to_canonical(t.detach()).cpu())

    metas = [torch.empty(rows.local, dtype=o.dtype, device="meta") if laid_out(o) else o for o in outputs]
    effects = keyed_effects(func, args, kwargs, metas, site, read, caller=caller)
    draws: list[Random] = []
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
    evaluator = _evaluator({draw: fold_in(key, j) for j, draw in enumerate(draws)}, rows)
    bound = bind_arguments(func, args, kwargs)
    device = kwargs.get("device")
    if device is None:
        device = next((a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)),
                      torch.device("cpu"))

    def value(node: Node, like: torch.Tensor) -> torch.Tensor:
        full = evaluator.full(node)
        if laid_out(like):
            full = rows.from_canonical(full)
        return full.to(like.device if like.device.type != "meta" else device).reshape(like.shape)

    with torch.no_grad():
        for name, node in effects.writes:
            target = bound[name]
            target.copy_(value(node, target))
    results = [bound.get("self", bound.get("out")) if node is None else value(node, meta)
               for node, meta in zip(effects.returns, outputs)]
    if isinstance(meta_out, torch.Tensor):
        return results[0]
    return tuple(results)
