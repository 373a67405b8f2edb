"""The Triton kernels that round or step several tensors in one launch (imported only when triton is
installed; the host side is :mod:`keyinit._kernels.fill.triton_sround_many`).

The launch reads a table of int64 rows, one per tensor: its run (``numel`` consecutive global indices
from ``base``), the number of its FQN's components and the offset of their fold inputs, then the
addresses of its tensors (and, for the Adam step, its scalars as binary32 bit patterns). ``firsts``
holds each row's first program and then the launch's total. Program ``pid`` finds its row by binary
search over ``firsts``, derives the row's key from the launch's base key as ``key_for`` does
(``docs/spec.md`` section 3: a string fold is ``Philox4x32-10((x0, x1, tag, x3), K)[0:2]``), then does
what the one-tensor RUN kernel (:mod:`keyinit._kernels.fill.triton_sround_run`) does for program
``pid - firsts[row]``, with the same ``@triton.jit`` functions: the same bits.
"""

import triton
import triton.language as tl

from keyinit._kernels.common.triton_philox import philox_hi
from keyinit._kernels.fill.triton_sround_impl import _adam_load, _adam_store, _adam_update
from keyinit._kernels.fill.triton_sround_run import _round_store, _run_positions

__all__ = ["sround_many_kernel", "adam_many_kernel", "MANY_INTS", "ROUND_COLUMNS", "ADAM_COLUMNS"]

I64 = tl.int64
#: The runtime integers (int64, never specialized on their values).
MANY_INTS = ["nrows", "k0", "k1", "tag"]
#: Columns of a row: numel, base, the FQN's components, their fold inputs' offset (in triples), then the
#: destination's and the source's addresses (rounding) or the parameter's, gradient's and moments'
#: addresses, has_decay and 17.6's eight binary32 scalars (the Adam step).
ROUND_COLUMNS = 6
ADAM_COLUMNS = 17
_ROUND_COLUMNS = tl.constexpr(ROUND_COLUMNS)  # (a jitted function reads constexpr globals only)
_ADAM_COLUMNS = tl.constexpr(ADAM_COLUMNS)


@triton.jit
def _row(firsts_ptr, table_ptr, words_ptr, nrows, k0, k1, tag, COLUMNS: tl.constexpr, SEARCH: tl.constexpr):
    """Program ``pid``'s row: ``(row pointer, program within the row, numel, base, key words a, b)``."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + nrows
    for step in tl.static_range(SEARCH):  # firsts[lo] <= pid < firsts[hi]
        mid = (lo + hi) // 2
        below = tl.load(firsts_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    row_ptr = table_ptr + lo * COLUMNS
    # key_for: the FQN's string folds, in order, from the base key
    a = k0.to(tl.uint32)
    b = k1.to(tl.uint32)
    t = tag.to(tl.uint32)
    fold_ptr = words_ptr + 3 * tl.load(row_ptr + 3)
    for d in range(tl.load(row_ptr + 2)):
        x0 = tl.load(fold_ptr + 3 * d).to(tl.uint32)
        x1 = tl.load(fold_ptr + 3 * d + 1).to(tl.uint32)
        x3 = tl.load(fold_ptr + 3 * d + 2).to(tl.uint32)
        a, b, c2, c3 = philox_hi(x0, x1, t, x3, a, b)  # (words 2-3 unused)
    return row_ptr, pid - tl.load(firsts_ptr + lo), tl.load(row_ptr), tl.load(row_ptr + 1), a, b


@triton.jit
def _f32_at(row_ptr, column):
    return tl.load(row_ptr + column).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=MANY_INTS)
def _sround_many_kernel(table_ptr, firsts_ptr, words_ptr, nrows: I64, k0: I64, k1: I64, tag: I64,
                        P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, NBITS: tl.constexpr,
                        HAS_INF: tl.constexpr, INF: tl.constexpr, NAN: tl.constexpr, MAXF: tl.constexpr,
                        NB: tl.constexpr, SEARCH: tl.constexpr):
    """Section 17's rounding of several binary32 tensors into one target format."""
    row_ptr, local, numel, base, a, b = _row(firsts_ptr, table_ptr, words_ptr, nrows, k0, k1, tag, _ROUND_COLUMNS,
                                             SEARCH)
    mask, o, x = _run_positions(local, numel, base, a, b, NB)
    if NBITS == 16:
        out_ptr = tl.load(row_ptr + 4).to(tl.pointer_type(tl.int16))
    else:
        out_ptr = tl.load(row_ptr + 4).to(tl.pointer_type(tl.uint8))
    src_ptr = tl.load(row_ptr + 5).to(tl.pointer_type(tl.int32))
    _round_store(out_ptr, src_ptr, o, mask, x, P, EMIN, EMAX, NBITS, HAS_INF, INF, NAN, MAXF)


@triton.jit(do_not_specialize=MANY_INTS)
def _adam_many_kernel(table_ptr, firsts_ptr, words_ptr, nrows: I64, k0: I64, k1: I64, tag: I64,
                      PTYPE: tl.constexpr, NB: tl.constexpr, SEARCH: tl.constexpr):
    """17.6's fused step of several parameters of one dtype (``PTYPE`` 0: bfloat16, 1: float16)."""
    row_ptr, local, numel, base, a, b = _row(firsts_ptr, table_ptr, words_ptr, nrows, k0, k1, tag, _ADAM_COLUMNS,
                                             SEARCH)
    mask, o, x = _run_positions(local, numel, base, a, b, NB)
    if PTYPE == 0:
        p_ptr = tl.load(row_ptr + 4).to(tl.pointer_type(tl.int16))
        g_ptr = tl.load(row_ptr + 5).to(tl.pointer_type(tl.int16))
    else:
        p_ptr = tl.load(row_ptr + 4).to(tl.pointer_type(tl.float16))
        g_ptr = tl.load(row_ptr + 5).to(tl.pointer_type(tl.float16))
    m_ptr = tl.load(row_ptr + 6).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row_ptr + 7).to(tl.pointer_type(tl.float32))
    p, grad, m0, v0 = _adam_load(p_ptr, g_ptr, m_ptr, v_ptr, o, mask, PTYPE)
    new, m, v = _adam_update(p, grad, m0, v0, _f32_at(row_ptr, 9), _f32_at(row_ptr, 10), _f32_at(row_ptr, 11),
                             _f32_at(row_ptr, 12), _f32_at(row_ptr, 13), _f32_at(row_ptr, 14), _f32_at(row_ptr, 15),
                             _f32_at(row_ptr, 16), tl.load(row_ptr + 8))
    _adam_store(p_ptr, m_ptr, v_ptr, o, mask, new, m, v, x, PTYPE)


sround_many_kernel = _sround_many_kernel
adam_many_kernel = _adam_many_kernel
