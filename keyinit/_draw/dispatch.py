"""Chooses the implementation of every kernel family: the one seam between keyinit and its kernels.

Eight families, each with one call here:

- :func:`fill`: a distribution's values for a region (``keyinit.random``, the
  initializers, replayed init code);
- :func:`dropout`: keyed dropout of a tensor laid out by a
  :class:`~keyinit._draw.dropout_geometry.Geometry` (the ``keyinit::dropout`` op and its
  eager form, ``keyinit.nn._ops.op``);
- :func:`permute`: the keyed permutation at some positions (``keyinit.data``);
- :func:`sround`: keyed stochastic rounding of a region's values (``keyinit.random.stochastic_round``,
  ``keyinit.optim``; ``docs/spec.md`` section 17);
- :func:`sround_fp4`: the same to FP4 E2M1 codes from binary64 quotients
  (``keyinit.random.stochastic_round_fp4``; ``docs/spec.md`` 17.7);
- :func:`sround_adam`: a fused, stochastically rounded Adam/AdamW step of one parameter
  (``keyinit.optim.stochastic_rounding(..., fused=True)``; ``docs/spec.md`` 17.6);
- :func:`sround_many` and :func:`sround_adam_many`: the rounding of several tensors, and the fused step of
  several parameters, under one step's base key (a device's kernel takes the ones it can in one launch
  and gives back the others, which go one by one).

Each stream version has each family as a :class:`Kernels` in :data:`KERNELS`,
the kernel table: a reference that runs on any device and kernels by device
type. Every kernel must produce exactly the reference's bits, and the tests hold
them to it. The table is one of keyinit's documented registries. Stream v1's
references are here, one floor below every kernel (``reference_fill``,
``reference_dropout``, ``reference_permutation``, ``reference_sround``); its kernels register
themselves from above (:func:`keyinit._kernels.register`, which importing keyinit calls):

- CPU tensors: the compiled C kernels (``keyinit._kernels.fill.cpu``,
  ``dropout.cpu``, ``permutation.cpu``), built on first use; if one cannot be
  built or fails its golden self-test, one ``RuntimeWarning`` and the reference;
- CUDA tensors: the Triton kernels (``keyinit._kernels.fill.triton``,
  ``dropout.triton``, ``permutation.triton``) when the optional ``triton``
  package is installed;
- anything else, or ``KEYINIT_DISABLE_KERNELS=1``: the reference.

So nothing here names a module above it, by import or by string. Implementations
are named by module and function (:class:`KernelRef`) and imported on first use,
so importing keyinit builds, loads and registers nothing with torch. A new stream
version registers its own families (:func:`register_family`); nothing here changes.

The fast fill kernels write ``out``'s memory directly. A view with torch's
negative bit (``x.conj().imag``) reads that memory negated, so it is filled
through a plain temporary and ``copy_``, which applies the view's semantics. A
meta ``out`` (a draw under ``torch.device("meta")``) has no memory: nothing is
computed.

A draw or permutation made while a ``TorchDispatchMode`` is active (keyinit's own capture:
``nn.Parameter(keyinit.random.normal(...))`` in a constructor built with ``keyinit.deferred``,
or in an ``init_method``) or into a tensor subclass (a stand-in, which has no memory) is
computed with the modes off, kernel self-test included: into ``out`` itself when it is a plain
tensor, else into a plain tensor then copied into ``out`` through the modes (the values are a pure
function of the key, so the capture records them as constants). No kernel ever writes through a
subclass's data pointer.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional

import attrs
import torch
from torch.utils._python_dispatch import _disable_current_modes

from keyinit._bits.streams import get_stream
from keyinit._draw.reference_permutation import permutation_key
from keyinit.distributions import Distribution
from keyinit.keys import Key, key_for
from keyinit.regions import Region

__all__ = ["KernelRef", "Kernels", "KERNELS", "FAMILIES", "kernels", "register_family", "register_kernel",
           "kernels_disabled", "fill", "dropout", "permute", "sround", "sround_fp4", "sround_adam", "sround_many",
           "sround_adam_many", "RoundItem", "AdamItem"]

#: The kernel families every stream version has.
FAMILIES = ("fill", "dropout", "permutation", "sround", "sround_fp4", "sround_adam", "sround_many",
            "sround_adam_many")


def kernels_disabled() -> bool:
    """True when ``KEYINIT_DISABLE_KERNELS`` is set to a true value (1, true, yes, on), read at each call."""
    if _ENVIRON_DATA is not None and os.environ is _ENVIRON:
        # ``os.environ``'s own dict (what ``os.environ.get`` reads), looked up without the KeyError that
        # ``get`` raises and catches for an unset variable: every kernel call asks
        raw = _ENVIRON_DATA.get(_DISABLE_KEY)
        if raw is None:
            return False
        value = os.environ.decodevalue(raw)
    else:  # pragma: no cover - another Python's os.environ
        value = os.environ.get("KEYINIT_DISABLE_KERNELS", "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def _environ_data() -> tuple[Optional[dict], Any]:
    data, encodekey = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encodekey is None or not hasattr(os.environ, "decodevalue"):
        return None, None  # pragma: no cover
    return data, encodekey("KEYINIT_DISABLE_KERNELS")


_ENVIRON = os.environ
_ENVIRON_DATA, _DISABLE_KEY = _environ_data()


@attrs.frozen
class KernelRef:
    """An implementation named by ``module`` and ``name``, imported when first resolved.

    Resolved at every call (a dictionary lookup once the module is imported), so
    an implementation replaced on its module (a test's ``monkeypatch``) is the one
    that runs.
    """

    module: str
    name: str

    def resolve(self) -> Optional[Callable[..., Any]]:
        """The function, or ``None`` when its module cannot be imported (e.g. no ``triton``)."""
        module = sys.modules.get(self.module)
        if module is None:
            try:
                module = importlib.import_module(self.module)
            except Exception:  # noqa: BLE001 - a kernel that cannot even be imported is unavailable
                return None
        return getattr(module, self.name)


def _read_only(devices: Mapping[str, KernelRef]) -> Mapping[str, KernelRef]:
    return MappingProxyType(dict(devices))


@attrs.frozen
class Kernels:
    """One kernel family of a stream: the ``reference`` (any device) and a kernel per device type.

    All take the same arguments. A kernel returns ``True`` when it wrote the
    result and ``False`` when it cannot (nothing written; the reference runs);
    the reference always writes it.
    """

    reference: KernelRef
    devices: Mapping[str, KernelRef] = attrs.field(default=(), converter=_read_only)

    def run(self, device: str, *args: Any, **kwargs: Any) -> None:
        """The kernel for ``device`` unless kernels are disabled (``KEYINIT_DISABLE_KERNELS``) or it
        declines, else the reference."""
        if not kernels_disabled():
            ref = self.devices.get(device)
            kernel = ref.resolve() if ref is not None else None
            if kernel is not None and kernel(*args, **kwargs):
                return
        reference = self.reference.resolve()
        if reference is None:  # pragma: no cover - the references import nothing optional
            raise ImportError(f"the reference {self.reference.module}.{self.reference.name} cannot be imported")
        reference(*args, **kwargs)


def _references(fill: KernelRef) -> dict[str, Kernels]:
    """Stream v1's references of every family, ``fill`` the fill's (a new table: each version has its own)."""
    return {
        "fill": Kernels(fill),
        "dropout": Kernels(KernelRef("keyinit._draw.reference_dropout", "dropout")),
        "permutation": Kernels(KernelRef("keyinit._draw.reference_permutation", "permute_into")),
        "sround": Kernels(KernelRef("keyinit._draw.reference_sround", "round_into")),
        "sround_fp4": Kernels(KernelRef("keyinit._draw.reference_sround", "round_fp4_into")),
        "sround_adam": Kernels(KernelRef("keyinit._draw.reference_sround", "adam_into")),
        # (a device kernel of these two takes (items, base) and returns the items it did not do)
        "sround_many": Kernels(KernelRef("keyinit._draw.reference_sround", "round_many")),
        "sround_adam_many": Kernels(KernelRef("keyinit._draw.reference_sround", "adam_many")),
    }


#: The kernel table: stream version name -> family -> :class:`Kernels`. The documented registry that
#: :func:`register_family` (a new version's references) and :func:`register_kernel` (a device's kernel) fill.
KERNELS: dict[str, dict[str, Kernels]] = {
    "v1": _references(KernelRef("keyinit._draw.reference_fill", "fill")),
    # v2 is v1 with keyed forwards' extent-free names (docs/spec.md 14.8), which reach the same families
    # through a geometry's high counter words: the same references (and kernels, keyinit._kernels), but for
    # the fills, whose reference also draws a keyed forward's random ops by those names (names.naming)
    "v2": _references(KernelRef("keyinit._draw.names", "fill")),
}


_NO_FAMILIES: dict = {}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; the families are {list(FAMILIES)}")


def register_family(stream: str, family: str, kernels: Kernels) -> Kernels:
    """Register ``kernels`` (a reference and kernels by device) as ``family`` of the stream version named
    ``stream`` (returns it). A family already registered is refused: a released version never changes."""
    _check_family(family)
    if not isinstance(kernels, Kernels):
        raise TypeError(f"register_family takes a Kernels, got {type(kernels).__name__}")
    families = KERNELS.setdefault(stream, {})
    if family in families:
        raise ValueError(f"stream {stream!r} already has its {family!r} kernels; a registered version never changes")
    families[family] = kernels
    return kernels


def register_kernel(stream: str, family: str, device: str, ref: KernelRef) -> None:
    """Make ``ref`` the ``family`` kernel of ``stream`` for tensors on ``device`` (a device type). It must give
    the reference's bits; registering the same kernel again changes nothing."""
    current = kernels(stream, family)
    KERNELS[stream][family] = attrs.evolve(current, devices={**current.devices, device: ref})


def kernels(stream: str, family: str) -> Kernels:
    """The registered ``family`` of the stream version named ``stream``."""
    _check_family(family)
    found = KERNELS.get(stream, {}).get(family)
    if found is None:
        get_stream(stream)  # an unknown version says so
        raise ValueError(f"stream {stream!r} has no {family!r} kernels registered")
    return found


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """Fill ``out`` (shaped like ``region``) with ``dist``'s values from ``key``'s stream."""
    family = kernels(key.stream, "fill")
    if out.numel() == 0 or out.device.type == "meta":
        return
    if _intercepted(out):
        with _disable_current_modes():
            if not _subclass(out):  # a plain tensor: filled in place, as always (the kernel writes its memory)
                fill(out, dist, key, region)
                return
            plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            fill(plain, dist, key, region)
        out.copy_(plain)
        return
    if out.is_neg() or out.is_conj():
        plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(plain, dist, key, region)
        out.copy_(plain)
        return
    family.run(out.device.type, out, dist, key, region)


def _subclass(tensor: torch.Tensor) -> bool:
    """``tensor`` is a ``__torch_dispatch__`` subclass (a stand-in, a fake or distributed tensor)."""
    return type(tensor).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def _intercepted(tensor: torch.Tensor) -> bool:
    """Ops on ``tensor`` do not reach its memory directly: a dispatch mode is active, or it is a subclass."""
    return torch._C._len_torch_dispatch_stack() > 0 or _subclass(tensor)


def dropout(x: torch.Tensor, geometry: Any) -> torch.Tensor:
    """Keyed dropout of ``x`` laid out by ``geometry`` (a :class:`keyinit._draw.dropout_geometry.Geometry`,
    which carries the key's words and stream version): a new contiguous tensor."""
    family = KERNELS.get(geometry.stream, _NO_FAMILIES).get("dropout") or kernels(geometry.stream, "dropout")
    x = x.contiguous()
    if type(x) is torch.Tensor:  # the same tensor as below (x is contiguous), made a third as slowly
        out = _empty_like(x, memory_format=_CONTIGUOUS)
    else:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    family.run("cpu" if x.is_cpu else x.device.type, x, out, geometry)  # (is_cpu: no device object made)
    return out


_empty_like = torch.empty_like
_CONTIGUOUS = torch.contiguous_format


def permute(key: Key, n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
            start: int = 0, step: int = 1) -> torch.Tensor:
    """``out[k] = perm(p_k)`` (``inverse``: ``perm^-1(p_k)``) of the keyed permutation of ``range(n)``
    (``2 <= n <= 2**62``), with ``p_k = positions[k]`` (an int64 tensor of ``out``'s shape, on its device)
    or ``start + step * k``; returns ``out``."""
    family = kernels(key.stream, "permutation")
    if out.numel() and (_intercepted(out) or (positions is not None and _intercepted(positions))):
        if positions is not None and _subclass(positions):
            positions = torch.tensor(positions.tolist(), dtype=torch.int64)  # its values (a stand-in computes them)
        with _disable_current_modes():
            if not _subclass(out):
                return permute(key, n, inverse, out, positions=positions, start=start, step=step)
            plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
            permute(key, n, inverse, plain, positions=positions, start=start, step=step)
        out.copy_(plain)
        return out
    if out.numel():
        kp = permutation_key(key, n).words  # derived in the key's own stream
        family.run(out.device.type, kp, n, inverse, out, positions=positions, start=start, step=step)
    return out


def sround(out: torch.Tensor, x: torch.Tensor, key: Key, region: Region) -> None:
    """Write ``x`` (float32 or float64, shaped like ``region``) rounded stochastically to ``out.dtype`` into
    ``out`` (same shape), keyed by ``key`` and each element's global index (``docs/spec.md`` section 17).
    Under a dispatch mode, into or from a subclass, or into a negated view: the reference, through torch."""
    family = kernels(key.stream, "sround")
    if out.numel() == 0 or out.device.type == "meta":
        return
    if _intercepted(out) or _intercepted(x) or out.is_neg() or out.is_conj():
        reference = family.reference.resolve()
        reference(out, x, key, region)
        return
    family.run(out.device.type, out, x, key, region)


def sround_fp4(out: torch.Tensor, v: torch.Tensor, key: Key, region: Region) -> None:
    """Write ``v`` (float64 quotients ``x / scale``, no NaN, shaped like ``region``) rounded stochastically to
    FP4 E2M1 into ``out`` (uint8 codes, same shape), keyed by ``key`` and each element's global index
    (``docs/spec.md`` 17.7). Under a dispatch mode, into or from a subclass: the reference, through torch."""
    family = kernels(key.stream, "sround_fp4")
    if out.numel() == 0 or out.device.type == "meta":
        return
    if _intercepted(out) or _intercepted(v):
        family.reference.resolve()(out, v, key, region)
        return
    family.run(out.device.type, out, v, key, region)


def sround_adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                key: Key, region: Region, scalars: "list[float]", has_decay: bool) -> None:
    """One fused Adam/AdamW step (``docs/spec.md`` 17.6) of ``param`` (bfloat16/float16, rounded
    stochastically with ``key`` at ``region``'s global indices) from ``grad`` and the float32 state
    ``exp_avg``/``exp_avg_sq``, all four of one shape, updated in place."""
    if param.numel() == 0 or param.device.type == "meta":
        return
    family = kernels(key.stream, "sround_adam")
    if any(_intercepted(t) for t in (param, grad, exp_avg, exp_avg_sq)):
        family.reference.resolve()(param, grad, exp_avg, exp_avg_sq, key, region, scalars, has_decay)
        return
    family.run(param.device.type, param, grad, exp_avg, exp_avg_sq, key, region, scalars, has_decay)


class RoundItem(NamedTuple):
    """One tensor of :func:`sround_many`: the arguments of :func:`sround`, with its FQN in place of its key
    (the key is ``key_for(base, fqn)``)."""

    out: torch.Tensor
    x: torch.Tensor
    fqn: str
    region: Region


class AdamItem(NamedTuple):
    """One parameter of :func:`sround_adam_many`: the arguments of :func:`sround_adam`, with its FQN in place
    of its key (the key is ``key_for(base, fqn)``)."""

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    fqn: str
    region: Region
    scalars: "list[float]"
    has_decay: bool


def _many(family_name: str, items: list, base: Key, one: Callable[[Any, Key], None]) -> None:
    """``items`` by the device's ``family_name`` kernel where it takes them, the others by ``one(item, key)``;
    the family's reference for all of them when kernels are off or a tensor is intercepted."""
    todo = [item for item in items if item[0].numel() and item[0].device.type != "meta"]
    family = kernels(base.stream, family_name)
    if not todo:
        return
    if kernels_disabled() or any(_intercepted(t) for item in todo for t in item if isinstance(t, torch.Tensor)):
        family.reference.resolve()(todo, base)
        return
    by_device: dict[str, list] = {}
    for item in todo:
        by_device.setdefault(item[0].device.type, []).append(item)
    for device, group in by_device.items():
        ref = family.devices.get(device)
        kernel = ref.resolve() if ref is not None else None
        for item in (kernel(group, base) if kernel is not None else group):
            one(item, key_for(base, item.fqn))


def sround_many(items: "list[RoundItem]", base: Key) -> None:
    """Keyed stochastic rounding (section 17) of several tensors, item ``i`` keyed by
    ``key_for(base, items[i].fqn)``: each gets exactly what :func:`sround` with that key gives. The device's
    ``sround_many`` kernel (CUDA: one launch per target format) rounds the items it can; the others go one
    by one."""
    _many("sround_many", items, base, lambda item, key: sround(item.out, item.x, key, item.region))


def sround_adam_many(items: "list[AdamItem]", base: Key) -> None:
    """Fused Adam/AdamW steps (``docs/spec.md`` 17.6) of several parameters, item ``i`` keyed by
    ``key_for(base, items[i].fqn)``: each gets exactly what :func:`sround_adam` with that key gives. The
    device's ``sround_adam_many`` kernel (CUDA: one launch per parameter dtype) steps the items it can;
    the others step one by one."""
    _many("sround_adam_many", items, base,
          lambda item, key: sround_adam(item.param, item.grad, item.exp_avg, item.exp_avg_sq, key, item.region,
                                        item.scalars, item.has_decay))
