"""Philox4x32-10 in Triton, the one copy every Triton kernel family calls (imported only when triton is installed).

Triton resolves a jitted function's callees through its module's globals, so a kernel module imports
:func:`philox` (counter words 2-3 zero: the element stream of ``docs/spec.md`` section 4) or
:func:`philox_hi` (any high counter words: stream v2's extent-free names, section 14.8) by name
(``from keyinit._kernels.common.triton_philox import philox``).
"""

import triton
import triton.language as tl

__all__ = ["philox", "philox_hi"]


@triton.jit
def philox_hi(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counters ``(c0, c1, c2, c3)`` under the key ``(k0, k1)`` (uint32 tensors)."""
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.math.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.math.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = tl.mul(a2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(a0, 0xD2511F53, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def philox(c0, c1, k0, k1):
    """Philox4x32-10 of the counters ``(c0, c1, 0, 0)`` under the key ``(k0, k1)`` (uint32 tensors)."""
    return philox_hi(c0, c1, tl.zeros_like(c0), tl.zeros_like(c0), k0, k1)
