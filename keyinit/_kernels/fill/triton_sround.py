"""Keyed stochastic rounding on CUDA tensors with Triton (``docs/spec.md`` section 17), bit-identical to
:mod:`keyinit._draw.reference_sround`: the sround family's CUDA kernel.

Triton is optional and imported lazily; :func:`sround` returns ``False`` (the reference runs) when it is
missing, for a float64 source, or for a stream whose element words are not v1's. The source is read at
the destination's offsets (laid out as ``out`` first when its strides differ). Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (``interpret_ok``), which is how
``tests/test_sround_triton.py`` checks it without a GPU. The kernel is
:mod:`keyinit._kernels.fill.triton_sround_impl`.
"""

from __future__ import annotations

import functools

import torch

from keyinit._bits.sround import TARGETS
from keyinit._bits.streams import stream_words
from keyinit._kernels.fill.launch import BLOCK
from keyinit._kernels.fill.triton import launch_args
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["available", "sround"]


@functools.lru_cache(maxsize=None)
def _kernel():
    try:
        from keyinit._kernels.fill.triton_sround_impl import sround_kernel
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return sround_kernel


def available() -> bool:
    return _kernel() is not None


def sround(out: torch.Tensor, x: torch.Tensor, key: Key, region: Region, *, interpret_ok: bool = False) -> bool:
    """``x`` (float32, shaped like ``region``) rounded stochastically into ``out`` (a section 17 target,
    any strides) with the Triton kernel; ``False`` (nothing written) if it cannot. CUDA tensors, or CPU
    tensors with ``interpret_ok`` (the tests, under ``TRITON_INTERPRET=1``)."""
    target = TARGETS.get(out.dtype)
    if (target is None or x.dtype != torch.float32 or x.device != out.device
            or key.impl.words is not stream_words or (out.device.type != "cuda" and not interpret_ok)):
        return False
    kernel = _kernel()
    if kernel is None:
        return False
    if out.numel() == 0:
        return True
    launch = launch_args(out, region, 1)
    if launch is None:
        return False
    src = x.detach()
    if src.is_neg() or any(n > 1 and a != b for n, a, b in zip(out.shape, out.stride(), src.stride())):
        src = torch.empty_strided(out.shape, out.stride(), dtype=torch.float32, device=out.device).copy_(src)
    if launch["index"] is not None:
        index = launch["index"].to(out.device)
    else:  # never read (every dim is a slice), but the kernel needs a pointer
        index = torch.empty(1, dtype=torch.int64, device=out.device)
    dims = launch["dims"]
    geometry_args = [d[0] for d in dims] + [d[1] for d in dims] + [d[2] for d in dims] + [d[3] for d in dims]
    storage = out.view(torch.int16 if target.nbits == 16 else torch.uint8)
    k0, k1 = key.words
    grid = (-(-out.numel() // BLOCK),)
    args = (storage, src.view(torch.int32), index, out.numel(), launch["base"], k0, k1, *geometry_args)
    options = dict(P=target.p, EMIN=target.emin, EMAX=target.emax, NBITS=target.nbits,
                   HAS_INF=int(target.inf is not None), INF=target.inf or 0, NAN=target.nan,
                   MAXF=target.max_finite, BLOCK=BLOCK)
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            kernel[grid](*args, **options)
    else:  # the interpreter (tests)
        kernel[grid](*args, **options)
    torch.autograd.graph.increment_version(out)
    return True
