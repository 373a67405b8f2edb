"""The RUN kernels of keyed stochastic rounding: a region that is one run of consecutive global indices
(a whole tensor, an FSDP dim-0 shard, any unit-step slice of rows) held contiguously in memory, one
tensor a launch (imported only when triton is installed; several tensors in one launch:
:mod:`keyinit._kernels.fill.triton_sround_many_impl`).

:mod:`keyinit._kernels.fill.triton_sround_impl`'s kernels decode every element's position and compute
a Philox block per element (they take any region). Here program ``pid`` owns ``NB`` consecutive Philox
blocks from the run's first block: each block is computed once and its 4 words are the words of 4
consecutive elements (``join`` of the four lanes, as the fill kernel's RUN path), the element offset
is ``g - base``: no division, no index list. The rounding and the Adam arithmetic are the same
``@triton.jit`` functions as the general kernels', so the bits are the same (``docs/spec.md`` 17.2,
17.6; FP4 E2M1's codes of binary64 quotients, 17.7, too); the bfloat16 target rounds by the carry of the word's high half (``sround.h``'s ``ki_sr_bf16``,
equal to 17.2's rule for every binary32 value) in 32-bit operations.
"""

import triton
import triton.language as tl

from keyinit._kernels.fill.triton_impl import _philox_blocks
from keyinit._kernels.fill.triton_sround_impl import _adam_load, _adam_store, _adam_update, _round, _round_fp4

__all__ = ["sround_run_kernel", "sround_fp4_run_kernel", "adam_run_kernel", "RUN_INTS", "ADAM_RUN_INTS"]

I64 = tl.int64
F32 = tl.float32
#: The runtime integers (int64, never specialized on their values).
RUN_INTS = ["numel", "base", "k0", "k1"]
ADAM_RUN_INTS = RUN_INTS + ["has_decay"]


@triton.jit
def _run_positions(pid, numel, base, k0, k1, NB: tl.constexpr):
    """Program ``pid``'s ``[NB, 4]`` elements: ``(mask, element offset, word)``; the word int64 in
    [0, 2**32). Element ``[j, l]`` is lane ``l`` of Philox block ``base // 4 + pid * NB + j``."""
    block = (base >> 2) + pid * NB + tl.arange(0, NB).to(tl.int64)
    r0, r1, r2, r3 = _philox_blocks(block, k0, k1)
    # element [j, i, l] of join(join(r0, r2), join(r1, r3)) is lane 2*i + l of block j
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [NB, 4])
    q = block[:, None] * 4 + tl.arange(0, 4).to(tl.int64)[None, :] - base
    mask = (q >= 0) & (q < numel)
    return mask, tl.where(mask, q, 0), words.to(tl.int64) & 0xFFFFFFFF


@triton.jit(do_not_specialize=RUN_INTS)
def _sround_run_kernel(out_ptr, src_ptr, numel: I64, base: I64, k0: I64, k1: I64,
                       P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, NBITS: tl.constexpr,
                       HAS_INF: tl.constexpr, INF: tl.constexpr, NAN: tl.constexpr, MAXF: tl.constexpr,
                       NB: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    mask, o, x = _run_positions(pid, numel, base, k0, k1, NB)
    _round_store(out_ptr, src_ptr, o, mask, x, P, EMIN, EMAX, NBITS, HAS_INF, INF, NAN, MAXF)


@triton.jit
def _round_store(out_ptr, src_ptr, o, mask, x, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                 NBITS: tl.constexpr, HAS_INF: tl.constexpr, INF: tl.constexpr, NAN: tl.constexpr,
                 MAXF: tl.constexpr):
    """The binary32 values at ``src_ptr + o`` (an int32 view) rounded with words ``x`` into ``out_ptr + o``."""
    u = tl.load(src_ptr + o, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    if NBITS == 16 and P == 8:  # bfloat16: the carry of the word's high half into the value's low half
        mag = u & 0x7FFFFFFF
        r = (mag >> 16) + (((x >> 16) + (mag & 0xFFFF)) >> 16)
        r = tl.where(mag > 0x7F800000, 0x7FC0, tl.where(mag == 0x7F800000, 0x7F80, r))
        bits = r | ((u >> 16) & 0x8000)
    else:
        bits = _round(u, x, P, EMIN, EMAX, NBITS, HAS_INF, INF, NAN, MAXF)
    if NBITS == 16:
        tl.store(out_ptr + o, tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + o, bits.to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=RUN_INTS)
def _sround_fp4_run_kernel(out_ptr, src_ptr, numel: I64, base: I64, k0: I64, k1: I64, NB: tl.constexpr):
    """FP4 E2M1 codes (17.7) of the binary64 quotients (their int64 view) over one run."""
    pid = tl.program_id(0).to(tl.int64)
    mask, o, x = _run_positions(pid, numel, base, k0, k1, NB)
    u = tl.load(src_ptr + o, mask=mask, other=0)
    tl.store(out_ptr + o, _round_fp4(u, x).to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=ADAM_RUN_INTS)
def _adam_run_kernel(p_ptr, g_ptr, m_ptr, v_ptr, numel: I64, base: I64, k0: I64, k1: I64,
                     decay: F32, w: F32, w_minus_1: F32, beta2: F32, s2: F32, bc2s: F32, eps: F32, neg_step: F32,
                     has_decay: I64, PTYPE: tl.constexpr, NB: tl.constexpr):
    """The fused Adam/AdamW step of 17.6 over one run (the general kernel's arithmetic and rounding)."""
    pid = tl.program_id(0).to(tl.int64)
    mask, o, x = _run_positions(pid, numel, base, k0, k1, NB)
    p, grad, m0, v0 = _adam_load(p_ptr, g_ptr, m_ptr, v_ptr, o, mask, PTYPE)
    new, m, v = _adam_update(p, grad, m0, v0, decay, w, w_minus_1, beta2, s2, bc2s, eps, neg_step, has_decay)
    _adam_store(p_ptr, m_ptr, v_ptr, o, mask, new, m, v, x, PTYPE)


sround_run_kernel = _sround_run_kernel
sround_fp4_run_kernel = _sround_fp4_run_kernel
adam_run_kernel = _adam_run_kernel
