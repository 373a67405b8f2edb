"""Layouts: which global elements a local tensor holds.

A :class:`Target` says where an initializer writes: the GLOBAL shape of a
parameter, the :class:`~keyinit.regions.Region` of it that this process holds,
and the plain local tensor (shaped like the region) that receives those
elements. A layout adapter turns a model tensor (plain, DTensor, a declared
manual shard, or anything a third party registers) into a Target.

The adapter protocol is deliberately tiny, in the spirit of
``torch.distributed.algorithms.Join``'s ``Joinable``: implement
:meth:`LayoutAdapter.target` and register the adapter.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import attrs
import torch

from keyinit.regions import Region, make_region

__all__ = ["Target", "LayoutAdapter", "register_layout", "target_for"]


@attrs.frozen(eq=False)
class Target:
    """A region of a global tensor, and the local tensor that holds it.

    ``out.shape == region.region_shape``; ``region.shape`` is the global shape.
    ``description`` names the layout for reports (e.g. ``"plain"``,
    ``"DTensor(Shard(0)) on mesh (2,)"``).
    """

    fqn: str
    region: Region
    out: torch.Tensor
    description: str = "plain"

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.region.shape


@runtime_checkable
class LayoutAdapter(Protocol):
    """Maps a tensor to the part of its global parameter it holds.

    ``target`` returns ``None`` when the adapter does not handle ``tensor``, so
    the next adapter is asked. ``module``/``name`` are where the tensor lives
    (``getattr(module, name) is tensor``); ``fqn`` is its canonical name.
    """

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        ...


class _PlainTensorLayout:
    """A plain tensor is the whole of its global parameter."""

    def target(self, tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Optional[Target]:
        shape = tuple(tensor.shape)
        return Target(fqn, make_region(shape, None), tensor, "plain")


# The documented registry of layout adapters: user-registered ones are asked first.
_USER_LAYOUTS: list[LayoutAdapter] = []


def register_layout(adapter: LayoutAdapter) -> LayoutAdapter:
    """Register ``adapter`` ahead of the built-in layouts (later registrations win)."""
    if not isinstance(adapter, LayoutAdapter):
        raise TypeError(f"{adapter!r} does not implement LayoutAdapter.target(tensor, *, fqn, module, name)")
    _USER_LAYOUTS.insert(0, adapter)
    return adapter


def _builtin_layouts() -> list[LayoutAdapter]:
    return [_PlainTensorLayout()]


def target_for(tensor: torch.Tensor, *, fqn: str, module: torch.nn.Module, name: str) -> Target:
    """The Target of ``tensor``: the first adapter that handles it decides."""
    for adapter in [*_USER_LAYOUTS, *_builtin_layouts()]:
        found = adapter.target(tensor, fqn=fqn, module=module, name=name)
        if found is not None:
            return found
    raise TypeError(f"{fqn}: no layout adapter handles a {type(tensor).__name__}")  # pragma: no cover
