"""Keyed stochastic rounding on CUDA tensors with Triton (``docs/spec.md`` section 17), bit-identical to
:mod:`keyinit._draw.reference_sround`: the sround family's CUDA kernel, the sround_fp4 family's
(:func:`sround_fp4`, FP4 E2M1 codes of 17.7) and the sround_adam family's (:func:`sround_adam`, the fused
Adam/AdamW step of 17.6).

Triton is optional and imported lazily; :func:`sround` returns ``False`` (the reference runs) when it is
missing, for a float64 source, or for a stream whose element words are not v1's. The source is read at
the destination's offsets (laid out as ``out`` first when its strides differ). Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (``interpret_ok``), which is how
``tests/gpu/test_sround_triton.py`` checks it without a GPU. The kernel is
:mod:`keyinit._kernels.fill.triton_sround_impl`.
"""

from __future__ import annotations

import functools
import struct

from typing import Any

import torch

from keyinit._bits.sround import TARGETS
from keyinit._bits.streams import stream_words
from keyinit._kernels.fill.launch import BLOCK
from keyinit._kernels.fill.triton import device_geometry, launch_for, run_kernel
from keyinit.keys import Key
from keyinit.regions import Region

__all__ = ["available", "sround", "sround_fp4", "sround_adam", "format_options", "round_f32"]


@functools.lru_cache(maxsize=None)
def _kernels() -> Any:
    """The general kernels' module and the RUN kernels' (``(None, None)`` when triton cannot be imported)."""
    try:
        from keyinit._kernels.fill import triton_sround_impl, triton_sround_run
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None, None
    return triton_sround_impl, triton_sround_run


def _kernel(name: str = "sround_kernel") -> Any:
    """The general kernel ``name`` (``None`` without triton)."""
    general, _ = _kernels()
    return None if general is None else getattr(general, name)


def _run_kernel(name: str) -> Any:
    """The RUN kernel ``name`` (called only once :func:`_kernel` found triton)."""
    return getattr(_kernels()[1], name)


#: Philox blocks per program of the RUN kernels (4 elements each).
RUN_NB = 256


def _single_run(launch: dict) -> bool:
    """Whether ``launch`` is one run of consecutive global indices stored contiguously (``launch["base"]``
    onwards): the RUN kernels' case."""
    dims = launch["dims"]
    return (launch["index"] is None and all(d[0] == 1 for d in dims[:-1])
            and dims[-1][1] == 1 and dims[-1][2] == 1)


def _run_grid(numel: int, base: int) -> tuple:
    return (-(-(numel + base % 4) // (4 * RUN_NB)),)


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
    launch = launch_for(kernel, out, region, 1)
    if not isinstance(launch, dict):
        return launch
    storage = out.view(torch.int16 if target.nbits == 16 else torch.uint8)
    _round(kernel, "sround_run_kernel", out, storage, _source(out, x).view(torch.int32), launch, key,
           format_options(target))
    return True


def sround_fp4(out: torch.Tensor, v: torch.Tensor, key: Key, region: Region, *, interpret_ok: bool = False) -> bool:
    """``v`` (float64 quotients ``x / scale``, no NaN, shaped like ``region``) rounded stochastically to FP4
    E2M1 codes into ``out`` (uint8, any strides; ``docs/spec.md`` 17.7) with the Triton kernel; ``False``
    (nothing written) if it cannot. CUDA tensors, or CPU tensors with ``interpret_ok``."""
    if (out.dtype != torch.uint8 or v.dtype != torch.float64 or v.device != out.device
            or key.impl.words is not stream_words or (out.device.type != "cuda" and not interpret_ok)):
        return False
    kernel = _kernel("sround_fp4_kernel")
    launch = launch_for(kernel, out, region, 1)
    if not isinstance(launch, dict):
        return launch
    _round(kernel, "sround_fp4_run_kernel", out, out, _source(out, v).view(torch.int64), launch, key,
           dict(enable_fp_fusion=False))  # (integer operations only)
    return True


def format_options(target: Any) -> dict:
    """A section 17.1 target format (``keyinit._bits.sround.TARGETS``'s) as the kernels' constexprs."""
    return dict(P=target.p, EMIN=target.emin, EMAX=target.emax, NBITS=target.nbits,
                HAS_INF=int(target.inf is not None), INF=target.inf or 0, NAN=target.nan, MAXF=target.max_finite)


def _source(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` with ``out``'s strides (the kernels read the source at the destination's offsets)."""
    src = x.detach()
    if src.is_neg() or any(n > 1 and a != b for n, a, b in zip(out.shape, out.stride(), src.stride())):
        src = torch.empty_strided(out.shape, out.stride(), dtype=x.dtype, device=out.device).copy_(src)
    return src


def _round(general: Any, run_name: str, out: torch.Tensor, storage: torch.Tensor, src: torch.Tensor,
           launch: dict, key: Key, options: dict) -> None:
    """One rounding launch into ``out`` (written through ``storage``, its integer view) from ``src``: the RUN
    kernel ``run_name`` for one run of consecutive global indices, else the ``general`` kernel."""
    k0, k1 = key.words
    if _single_run(launch):
        run_kernel(_run_kernel(run_name), _run_grid(out.numel(), launch["base"]), out.device,
                   (storage, src, out.numel(), launch["base"], k0, k1), dict(options, NB=RUN_NB))
    else:
        index, geometry_args = device_geometry(launch, out.device)
        run_kernel(general, (-(-out.numel() // BLOCK),), out.device,
                   (storage, src, index, out.numel(), launch["base"], k0, k1, *geometry_args),
                   dict(options, BLOCK=BLOCK))
    torch.autograd.graph.increment_version(out)


#: The parameter types of the fused step's kernel (its ``PTYPE``: keyinit._kernels.fill.cpu.ADAM_TYPES's ids).
_ADAM_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 4}


def round_f32(value: float) -> float:
    """``value`` rounded to binary32 (to nearest even; past its range: torch's rounding, to infinity)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return float(torch.tensor(value, dtype=torch.float32, device="cpu"))


def sround_adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                key: Key, region: Region, scalars: "list[float]", has_decay: bool, *,
                interpret_ok: bool = False) -> bool:
    """The fused Adam/AdamW step (``docs/spec.md`` 17.6) with the Triton kernel: the arguments of
    :func:`keyinit._draw.dispatch.sround_adam`, all four tensors contiguous, of one shape and device
    (CUDA, or CPU with ``interpret_ok``); ``False`` (nothing written) if it cannot."""
    ptype = _ADAM_TYPES.get(param.dtype)
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if (ptype is None or grad.dtype != param.dtype or exp_avg.dtype != torch.float32
            or exp_avg_sq.dtype != torch.float32 or key.impl.words is not stream_words
            or (param.device.type != "cuda" and not interpret_ok)
            or any(t.device != param.device or not t.is_contiguous() or t.shape != param.shape for t in tensors)):
        return False
    kernel = _kernel("adam_kernel")
    launch = launch_for(kernel, param, region, 1)
    if not isinstance(launch, dict):
        return launch
    decay, w, beta2, s2, bc2s, eps, neg_step = (round_f32(s) for s in scalars)
    bits = (lambda t: t.view(torch.int16)) if param.dtype == torch.bfloat16 else (lambda t: t)
    k0, k1 = key.words
    floats = (decay, w, w - 1.0, beta2, s2, bc2s, eps, neg_step, int(bool(has_decay)))
    tensors = (bits(param), bits(grad), exp_avg, exp_avg_sq)
    if _single_run(launch):
        run_kernel(_run_kernel("adam_run_kernel"), _run_grid(param.numel(), launch["base"]), param.device,
                   (*tensors, param.numel(), launch["base"], k0, k1, *floats),
                   dict(PTYPE=ptype, NB=RUN_NB, enable_fp_fusion=False))
    else:
        index, geometry_args = device_geometry(launch, param.device)
        args = (*tensors, index, param.numel(), launch["base"], k0, k1, *geometry_args, *floats)
        grid = (-(-param.numel() // BLOCK),)
        run_kernel(kernel, grid, param.device, args, dict(PTYPE=ptype, BLOCK=BLOCK, enable_fp_fusion=False))
    for t in (param, exp_avg, exp_avg_sq):
        torch.autograd.graph.increment_version(t)
    return True
