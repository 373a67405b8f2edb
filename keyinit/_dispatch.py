"""Chooses the implementation of every kernel family: the one seam between keyinit and its kernels.

Three families, each with one call here:

- :func:`fill`: a distribution's values for a region (``keyinit.random``, the
  initializers, replayed init code);
- :func:`dropout`: keyed dropout of a tensor laid out by a
  :class:`~keyinit.nn._geometry.Geometry` (the ``keyinit::dropout`` op and its
  eager form, ``keyinit.nn._op``);
- :func:`permute`: the keyed permutation at some positions (``keyinit.data``).

Each family has a reference implementation that runs on any device, and
kernels by device type (:class:`Kernels`); every kernel must produce exactly
the reference's bits, and the tests hold them to it:

- CPU tensors: the compiled C kernels (``keyinit._kernels._cpu``,
  ``_dropout_cpu``, ``_permutation_cpu``), built on first use; if one cannot be
  built or fails its golden self-test, one ``RuntimeWarning`` and the reference;
- CUDA tensors: the Triton kernels (``keyinit._kernels.triton_kernel``,
  ``triton_dropout``, ``triton_permutation``) when the optional ``triton``
  package is installed;
- anything else, or ``KEYINIT_DISABLE_KERNELS=1``: the reference.

Implementations are named by module and function (:class:`KernelRef`) and
imported on first use, so importing keyinit builds, loads and registers nothing.

The fast fill kernels write ``out``'s memory directly. A view with torch's
negative bit (``x.conj().imag``) reads that memory negated, so it is filled
through a plain temporary and ``copy_``, which applies the view's semantics. A
meta ``out`` (a draw under ``torch.device("meta")``) has no memory: nothing is
computed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Optional

import attrs
import torch

from keyinit._kernels import kernels_disabled
from keyinit.distributions import Distribution
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["KernelRef", "Kernels", "fill", "dropout", "permute"]


@attrs.frozen
class KernelRef:
    """An implementation named by ``module`` and ``name``, imported when first called.

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
    """One kernel family: the ``reference`` (any device) and a kernel per device type (``"cpu"``, ``"cuda"``).

    All take the same arguments. A kernel returns ``True`` when it wrote the
    result and ``False`` when it cannot (then nothing is written and the next
    choice runs); the reference always writes it.
    """

    reference: KernelRef
    devices: Mapping[str, KernelRef] = attrs.field(converter=_read_only)

    def run(self, device: str, *args: Any, **kwargs: Any) -> None:
        """The kernel for ``device`` unless kernels are disabled or it declines, else the reference."""
        if not kernels_disabled():
            ref = self.devices.get(device)
            kernel = ref.resolve() if ref is not None else None
            if kernel is not None and kernel(*args, **kwargs):
                return
        reference = self.reference.resolve()
        assert reference is not None, f"the reference {self.reference} cannot be imported"
        reference(*args, **kwargs)


#: The kernels of stream v1.
FILL = Kernels(KernelRef("keyinit._reference", "fill"), {
    "cpu": KernelRef("keyinit._kernels._cpu", "fill"),
    "cuda": KernelRef("keyinit._kernels.triton_kernel", "fill"),
})
DROPOUT = Kernels(KernelRef("keyinit.nn._reference", "dropout"), {
    "cpu": KernelRef("keyinit._kernels._dropout_cpu", "run"),
    "cuda": KernelRef("keyinit._kernels.triton_dropout", "run"),
})
PERMUTATION = Kernels(KernelRef("keyinit.data._feistel", "permute_into"), {
    "cpu": KernelRef("keyinit._kernels._permutation_cpu", "run"),
    "cuda": KernelRef("keyinit._kernels.triton_permutation", "run"),
})


def _check_stream(stream: str) -> None:
    if stream != "v1":  # pragma: no cover - guarded by Key's validator
        raise ValueError(f"no implementation for stream {stream!r}")


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region) -> None:
    """Fill ``out`` (shaped like ``region``) with ``dist``'s values from ``key``'s stream."""
    _check_stream(key.stream)
    if out.numel() == 0 or out.device.type == "meta":
        return
    if out.is_neg() or out.is_conj():
        plain = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        fill(plain, dist, key, region)
        out.copy_(plain)
        return
    FILL.run(out.device.type, out, dist, key, region)


def dropout(x: torch.Tensor, geometry: Any) -> torch.Tensor:
    """Keyed dropout of ``x`` laid out by ``geometry`` (a :class:`keyinit.nn._geometry.Geometry`): a new
    contiguous tensor."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    DROPOUT.run(x.device.type, x, out, geometry)
    return out


def permute(key: Key, n: int, inverse: bool, out: torch.Tensor, *, positions: Optional[torch.Tensor] = None,
            start: int = 0, step: int = 1) -> torch.Tensor:
    """``out[k] = perm(p_k)`` (``inverse``: ``perm^-1(p_k)``) of the keyed permutation of ``range(n)``
    (``2 <= n <= 2**62``), with ``p_k = positions[k]`` (an int64 tensor of ``out``'s shape, on its device)
    or ``start + step * k``; returns ``out``."""
    from keyinit.data._feistel import permutation_key

    _check_stream(key.stream)
    if out.numel():
        kp = permutation_key(key, n).words
        PERMUTATION.run(out.device.type, kp, n, inverse, out, positions=positions, start=start, step=step)
    return out
