"""The compiled CPU kernel: planning a fill and calling ``keyinit_fill`` through ctypes.

The kernel writes straight into ``out`` (any strides) with a bounded stack
workspace per thread, and runs on ``torch.get_num_threads()`` threads; the
values do not depend on that number. See ``fill_kernels.c`` for the
element addressing.

:func:`fill_named` is a keyed forward's draw under stream v2 (``docs/spec.md`` 14.8): the same kernel
(``keyinit_fill_high``) on :func:`keyinit._draw.names.named_geometry`, the elements' extent-free names as
low indices and high counter words; :func:`fill_v2` is stream v2's CPU fill kernel (it, while
:func:`keyinit._draw.names.naming` is open, else :func:`fill`).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from keyinit.distributions import Bernoulli, Distribution, Normal, Randint, TruncatedNormal, Uniform
from keyinit.keys import Key
from keyinit.regions import Region

from keyinit._bits.streams import stream_words
from keyinit._kernels.fill import selftest as _selftest
from keyinit._kernels.fill import selftest_sround as _selftest_sround
from keyinit._kernels.common.ids import DIST_IDS, DTYPE_IDS
from keyinit._kernels.common.library import I64P, MAX_DIMS, CompiledLibrary
from keyinit._draw.geometry import geometry
from keyinit._draw.names import named_geometry, naming_shape

__all__ = ["KERNEL", "available", "fill", "fill_named", "fill_v2", "fill_folded", "sround", "SROUND_TARGETS", "sround_fp4", "SROUND_FP4", "sround_adam", "ADAM_TYPES", "mt_seed", "library", "kernel_params", "DIST_IDS", "DTYPE_IDS", "MIN_PARALLEL_ELEMENTS"]

#: Below this many elements one thread does the work (thread start-up would dominate).
MIN_PARALLEL_ELEMENTS = 1 << 16



def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the ctypes signatures of the kernel library's functions."""
    lib.keyinit_fill.restype = ctypes.c_int
    lib.keyinit_fill.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32,
        ctypes.POINTER(ctypes.c_double), I64P,
        ctypes.c_int, ctypes.c_int64, I64P, I64P, I64P,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int,
    ]
    lib.keyinit_constants.restype = ctypes.c_int
    lib.keyinit_constants.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int]
    lib.keyinit_convert_f32.restype = None
    lib.keyinit_convert_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    lib.keyinit_ndtri_tail.restype = None
    lib.keyinit_ndtri_tail.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.keyinit_derive.restype = ctypes.c_uint64
    lib.keyinit_derive.argtypes = [ctypes.c_uint32] * 6
    lib.keyinit_fill_high.restype = ctypes.c_int
    lib.keyinit_fill_high.argtypes = lib.keyinit_fill.argtypes + [
        ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.keyinit_fill_folded.restype = ctypes.c_int
    lib.keyinit_fill_folded.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_double), I64P, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
    ]
    lib.keyinit_mt_seed.restype = None
    lib.keyinit_mt_seed.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p]
    lib.keyinit_sround.restype = ctypes.c_int
    lib.keyinit_sround.argtypes = [
        ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_int64, I64P, I64P, I64P,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]
    lib.keyinit_sround_adam.restype = ctypes.c_int
    lib.keyinit_sround_adam.argtypes = [
        ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int, ctypes.c_int64, I64P, I64P, I64P,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_float), ctypes.c_int, ctypes.c_int,
    ]
    lib.keyinit_philox_range.restype = None
    lib.keyinit_philox_range.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint32,
                                         ctypes.c_void_p]
    return lib


def _selftest_run(lib: ctypes.CDLL) -> list[str]:
    failed = _selftest.run(lambda out, dist, key, region, threads: fill(out, dist, key, region, threads=threads,
                                                                       lib=lib))
    failed += _selftest.run_named(
        lambda out, dist, key, region, sample_shape, threads: fill_named(out, dist, key, region, sample_shape,
                                                                         threads=threads, lib=lib))
    failed += _selftest.run_folded(
        lib.keyinit_derive, lambda out, dist, key, region: fill(out, dist, key, region, threads=1, lib=lib),
        lambda out, dist, key, fold0, fold1: fill_folded(out, dist, key, fold0, fold1, threads=1, lib=lib))
    failed += _selftest_sround.run(lambda out, x, key, region, threads: sround(out, x, key, region,
                                                                               threads=threads, lib=lib))
    failed += _selftest_sround.run_fp4(lambda out, v, key, region, threads: sround_fp4(out, v, key, region,
                                                                                   threads=threads, lib=lib))
    failed += _selftest_sround.run_adam(lambda p, g, m, v, key, region, scalars, has_decay, threads: sround_adam(
        p, g, m, v, key, region, scalars, has_decay, threads=threads, lib=lib))
    return failed + _selftest.run_mt_seed(lambda key: mt_seed(key, lib))


#: The init kernel library (``fill_kernels.c``), loaded through the one loader.
KERNEL = CompiledLibrary("the compiled CPU kernel", "fill/fill_kernels.c", declare, _selftest_run)
#: Looked up at each call, so a test can patch it; ``LIBRARY``, ``UNCHECKED``, ``SOURCE``, ... are the loader's.
library = KERNEL.library
__getattr__ = KERNEL.module_attribute


def kernel_params(dist: Distribution) -> tuple[list[float], list[int]]:
    f = [0.0] * 6
    i = [0] * 4
    if isinstance(dist, Uniform):
        f[0], f[1] = dist.low, dist.span
    elif isinstance(dist, Normal):
        f[0], f[1] = dist.mean, dist.std
    elif isinstance(dist, TruncatedNormal):
        f[:6] = [dist.mean, dist.std, dist.p_low, dist.p_span, dist.lower, dist.upper]
        i[0] = int(dist.flip)
    elif isinstance(dist, Bernoulli):
        i[1] = dist.threshold
    elif isinstance(dist, Randint):
        i[2], i[3] = dist.low, dist.span
    return f, i


def fill(out: torch.Tensor, dist: Distribution, key: Key, region: Region, threads: Optional[int] = None,
         lib: Optional[ctypes.CDLL] = None) -> bool:
    """Fill ``out`` with the kernel; ``False`` (nothing written) if the kernel cannot do it.

    ``threads`` defaults to ``torch.get_num_threads()`` (one thread for small fills);
    ``lib`` to the library built for this machine (tests pass other builds).
    """
    if not _takes(out, dist) or (lib := _library(lib)) is None:
        return False
    base, dims = geometry(out, region)
    return _launch(out, dist, key, base, dims, threads, lib)


def fill_named(out: torch.Tensor, dist: Distribution, key: Key, region: Region, sample_shape: tuple[int, ...],
               threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """:func:`keyinit._draw.names.fill_named`'s values for ``region`` (positions of the canonical tensor of
    ``sample_shape`` samples) with the kernel; ``False`` (nothing written) if the kernel cannot do it."""
    if not _takes(out, dist) or (lib := _library(lib)) is None:
        return False
    if out.numel() == 0:
        return True
    planned = named_geometry(out, region, sample_shape, dist.words_per_element)
    if planned is None:
        return False
    base, high, dims, high_index = planned
    return _launch(out, dist, key, base, dims, threads, lib, (high, [d[4] for d in dims], high_index))


def fill_v2(out: torch.Tensor, dist: Distribution, key: Key, region: Region, threads: Optional[int] = None,
            lib: Optional[ctypes.CDLL] = None) -> bool:
    """Stream v2's CPU fill kernel: :func:`fill_named` while :func:`keyinit._draw.names.naming` is open (a
    keyed forward's random op), else :func:`fill` (v2 is v1 there)."""
    sample_shape = naming_shape()
    if sample_shape is None:
        return fill(out, dist, key, region, threads, lib)
    return fill_named(out, dist, key, region, sample_shape, threads, lib)


def _library(lib: Optional[ctypes.CDLL]) -> Optional[ctypes.CDLL]:
    """``lib``, else the library built for this machine (``None``: it cannot be built or failed its self-test)."""
    return lib if lib is not None else KERNEL.usable(library)


def _takes(out: torch.Tensor, dist: Distribution) -> bool:
    return (type(dist) in DIST_IDS and out.dtype in DTYPE_IDS and out.device.type == "cpu"
            and out.dim() <= MAX_DIMS)


def _threads(numel: int, threads: Optional[int]) -> int:
    """``threads``, by default ``torch.get_num_threads()`` (one thread below :data:`MIN_PARALLEL_ELEMENTS`)."""
    if threads is not None:
        return threads
    return 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, torch.get_num_threads())


def _dim_arrays(dims: list) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array, ctypes.Array]:
    """A geometry's dims as the kernels' four per-dimension arguments: sizes, output strides, global strides
    and index vectors' pointers (NULL where a dim has none; the caller keeps the vectors alive)."""
    nd = len(dims)
    return ((ctypes.c_int64 * nd)(*(d[0] for d in dims)), (ctypes.c_int64 * nd)(*(d[1] for d in dims)),
            (ctypes.c_int64 * nd)(*(d[2] for d in dims)),
            (ctypes.c_void_p * nd)(*(None if d[3] is None else d[3].data_ptr() for d in dims)))


def _launch(out: torch.Tensor, dist: Distribution, key: Key, base: int, dims: list, threads: Optional[int],
            lib: ctypes.CDLL, high: Optional[tuple[int, list[int], Optional[torch.Tensor]]] = None) -> bool:
    """``keyinit_fill`` (``high``: ``keyinit_fill_high`` with ``(high_base, high_strides, high_index)``)."""
    nd = len(dims)
    f, i = kernel_params(dist)
    fparams = (ctypes.c_double * 6)(*f)  # binary32 values, exact as doubles; the kernel converts
    iparams = (ctypes.c_int64 * 4)(*i)
    k0, k1 = key.words
    keep_alive = [d[3] for d in dims]  # noqa: F841 - index vectors must outlive the call
    args = (dist_id := DIST_IDS[type(dist)], DTYPE_IDS[out.dtype], k0, k1, fparams, iparams, nd, base,
            *_dim_arrays(dims), out.data_ptr(), _threads(out.numel(), threads))
    if high is None:
        rc = lib.keyinit_fill(*args)
    else:
        hbase, hstrides, high_index = high
        hindex = None
        if high_index is not None:  # (one dim: named_geometry lists each element's high words)
            hindex = (ctypes.c_void_p * nd)(high_index.data_ptr())
        rc = lib.keyinit_fill_high(*args, hbase & 0xFFFFFFFFFFFFFFFF, (ctypes.c_int64 * nd)(*hstrides), hindex)
    if rc != 0:  # pragma: no cover - arguments are validated above
        raise RuntimeError(f"keyinit_fill failed with code {rc} (distribution {dist_id})")
    # The write bypassed torch, so bump the version counter as an in-place op would.
    torch.autograd.graph.increment_version(out)
    return True


def fill_folded(out: torch.Tensor, dist: Distribution, key: Key, fold0: int, fold1: int,
                threads: Optional[int] = None, lib: Optional[ctypes.CDLL] = None) -> bool:
    """Fill a contiguous CPU ``out`` (global flat indices from 0) under ``fold_in(fold_in(key, fold0), fold1)``
    (ints in ``[0, 2**64)``), the folds in C; ``False`` (nothing written) if the kernel cannot do it."""
    dist_id = DIST_IDS.get(type(dist))
    dtype_id = DTYPE_IDS.get(out.dtype)
    if (dist_id is None or dtype_id is None or out.device.type != "cpu" or not out.is_contiguous()
            or key.stream != "v1" or (lib := _library(lib)) is None):
        return False
    f, i = kernel_params(dist)
    rc = lib.keyinit_fill_folded(dist_id, dtype_id, key.k0, key.k1, fold0, fold1, (ctypes.c_double * 6)(*f),
                                 (ctypes.c_int64 * 4)(*i), out.numel(), out.data_ptr(), _threads(out.numel(), threads))
    if rc != 0:  # pragma: no cover - arguments are validated above
        raise RuntimeError(f"keyinit_fill_folded failed with code {rc}")
    torch.autograd.graph.increment_version(out)
    return True


#: The targets of ``keyinit_sround`` (its ``KI_SR_*`` ids, ``sround.h``), from binary32 sources.
SROUND_TARGETS = {torch.bfloat16: 0, torch.float16: 1, torch.float8_e5m2: 2, torch.float8_e4m3fn: 3}


def sround(out: torch.Tensor, x: torch.Tensor, key: Key, region: Region, threads: Optional[int] = None,
           lib: Optional[ctypes.CDLL] = None) -> bool:
    """Keyed stochastic rounding (``docs/spec.md`` section 17) of ``x`` (float32, shaped like ``region``)
    into ``out`` with ``keyinit_sround``: the fill kernel's words of the region (as ``bits`` draws them),
    then section 17.2's integer rule. ``False`` (nothing written) if the kernel cannot do it (a float64
    source, a device other than the CPU, a stream whose element words are not v1's)."""
    target = SROUND_TARGETS.get(out.dtype)
    if target is None or x.dtype != torch.float32:
        return False
    return _sround_launch(target, out, x, key, region, threads, lib)


#: ``keyinit_sround``'s target id of FP4 E2M1 from binary64 quotients (``sround_fp4.h``'s ``KI_SR_FP4_E2M1``).
SROUND_FP4 = 4


def sround_fp4(out: torch.Tensor, v: torch.Tensor, key: Key, region: Region, threads: Optional[int] = None,
               lib: Optional[ctypes.CDLL] = None) -> bool:
    """Keyed stochastic rounding to FP4 E2M1 (``docs/spec.md`` 17.7) of ``v`` (float64, the quotient
    ``x / scale``, no NaN; shaped like ``region``) into ``out`` (uint8 codes, any strides) with
    ``keyinit_sround``'s E2M1 target (``sround_fp4.h``). ``False`` (nothing written) if the kernel cannot
    do it (another dtype or device, a stream whose element words are not v1's)."""
    if out.dtype != torch.uint8 or v.dtype != torch.float64:
        return False
    return _sround_launch(SROUND_FP4, out, v, key, region, threads, lib)


def _sround_launch(target: int, out: torch.Tensor, x: torch.Tensor, key: Key, region: Region,
                   threads: Optional[int], lib: Optional[ctypes.CDLL]) -> bool:
    """``keyinit_sround`` of ``target`` from ``x`` (its source dtype checked by the caller) into ``out``."""
    if (out.device.type != "cpu" or x.device.type != "cpu" or out.dim() > MAX_DIMS
            or key.impl.words is not stream_words or (lib := _library(lib)) is None):
        return False
    if out.numel() == 0:
        return True
    base, dims = geometry(out, region)
    src = x.detach()
    if src.is_neg() or any(n > 1 and a != b for n, a, b in zip(out.shape, out.stride(), src.stride())):
        # the kernel reads the source at the destination's offsets: the values laid out as out is
        src = torch.empty_strided(out.shape, out.stride(), dtype=x.dtype, device="cpu").copy_(src)
    keep_alive = [d[3] for d in dims]  # noqa: F841 - index vectors must outlive the call
    rc = lib.keyinit_sround(target, key.k0, key.k1, len(dims), base, *_dim_arrays(dims), src.data_ptr(),
                            out.data_ptr(), _threads(out.numel(), threads))
    if rc != 0:  # pragma: no cover - arguments are validated above
        raise RuntimeError(f"keyinit_sround failed with code {rc}")
    torch.autograd.graph.increment_version(out)
    return True


#: The parameter types of ``keyinit_sround_adam`` (``sround_adam.h``): rounded stochastically, or float32 as is.
ADAM_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 4}


def sround_adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                key: Key, region: Region, scalars: "list[float]", has_decay: bool, threads: Optional[int] = None,
                lib: Optional[ctypes.CDLL] = None) -> bool:
    """One fused Adam step of ``param`` (bfloat16/float16, rounded stochastically with ``key``'s words of
    ``region``; float32 written as is) from ``grad`` (its dtype) and the float32 state, all four contiguous
    CPU tensors of one shape (``sround_adam.h``). ``scalars``: decay, w, beta2, s2, bc2s, eps, neg_step
    (each rounded to float32 here, as torch rounds a Python scalar). ``False`` (nothing written) if the
    kernel cannot do it."""
    ptype = ADAM_TYPES.get(param.dtype)
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if (ptype is None or grad.dtype != param.dtype or exp_avg.dtype != torch.float32
            or exp_avg_sq.dtype != torch.float32 or param.dim() > MAX_DIMS or key.impl.words is not stream_words
            or any(t.device.type != "cpu" or not t.is_contiguous() or t.shape != param.shape for t in tensors)
            or (lib := _library(lib)) is None):
        return False
    if param.numel() == 0:
        return True
    base, dims = geometry(param, region)
    keep_alive = [d[3] for d in dims]  # noqa: F841 - index vectors must outlive the call
    rc = lib.keyinit_sround_adam(ptype, key.k0, key.k1, len(dims), base, *_dim_arrays(dims), param.data_ptr(),
                                 grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                                 (ctypes.c_float * 7)(*scalars), int(has_decay), _threads(param.numel(), threads))
    if rc != 0:  # pragma: no cover - arguments are validated above
        raise RuntimeError(f"keyinit_sround_adam failed with code {rc}")
    for t in (param, exp_avg, exp_avg_sq):
        torch.autograd.graph.increment_version(t)
    return True


def mt_seed(key: list[int], lib: ctypes.CDLL) -> list[int]:
    """The 624 MT19937 state words of ``init_by_array(key)`` (one or two 32-bit words; CPython's and
    numpy's seeding)."""
    if len(key) not in (1, 2):
        raise ValueError(f"keyinit_mt_seed takes a key of one or two words, got {len(key)}")
    words = (ctypes.c_uint32 * 624)()
    lib.keyinit_mt_seed(key[0], key[-1], len(key), ctypes.addressof(words))
    return list(words)
