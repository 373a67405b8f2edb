"""Fast implementations of stream v1, each bit-identical to its reference in :mod:`keyinit._draw`.

One folder per kernel family, each with the same four parts: ``cpu.py`` (its C kernel, called
through ctypes), the C source, ``triton.py`` (its Triton kernel for CUDA tensors, used when the
optional ``triton`` package is installed) and ``selftest.py`` (the golden digests a compiled
library must reproduce before it is used):

- ``fill/``: a distribution's values for a region (``fill_kernels.c``; its binary32 transforms,
  log and the normal quantile, are ``fill/fp32math.h``, its stores ``fill/store.h``), and under stream
  v2 a keyed forward's random op by the elements' extent-free names (``keyinit_fill_high``);
- ``dropout/``: keyed dropout (``dropout_kernels.c``);
- ``permutation/``: the keyed permutation (``permutation_kernels.c``);
- keyed stochastic rounding (``docs/spec.md`` section 17) is the fill library's ``keyinit_sround``
  (``fill/sround.h``: the fill walk's words, then section 17.2's integer rule; CPU, binary32 sources;
  ``fill/selftest_sround.py`` its golden digests), on CUDA ``fill/triton_sround.py`` (Triton); FP4 E2M1
  from binary64 quotients (17.7) is its target ``KI_SR_FP4_E2M1`` (``fill/sround_fp4.h``) and
  ``fill/triton_sround.py``'s ``sround_fp4``; the
  fused Adam/AdamW step of section 17.6 is ``keyinit_sround_adam`` (``fill/sround_adam.h``, CPU) and
  ``fill/triton_sround.py``'s ``sround_adam`` (CUDA; a region that is one run of consecutive global
  indices takes ``fill/triton_sround_run.py``'s RUN kernels, a Philox block per 4 elements), and for a
  whole optimizer step ``fill/triton_sround_many.py`` (all parameters of a dtype in one launch, their
  keys derived on the device; ``sround_many`` likewise rounds an optimizer step's float32 results):
  the other cases take the reference.

``common/`` is what they share: one Philox (``philox.h``; ``triton_philox.py`` for Triton), one
set of float conversions (``convert.h``), one thread pool (``parallel.h``), the distribution and
dtype ids (``ids.py``, given to the C sources as ``-D`` definitions, ``ids.h`` checks them), and
one loader (:class:`~keyinit._kernels.common.library.CompiledLibrary`, which holds the names a
kernel module gives its library): compiled on first use by ``common/build.py`` (which refuses
builds that change floating-point semantics and verifies cached builds), then proved against the
family's golden digests.

The fill and dropout kernels take their geometry from :mod:`keyinit._draw.geometry`: slices
stay ``(start, step, count)``, so a contiguous run of a region shares Philox blocks.
:func:`register` puts them in :mod:`keyinit._draw.dispatch`'s table (importing keyinit calls it once:
nothing is imported, built or loaded until a kernel is first called), and the dispatcher chooses
among them and the reference. Set ``KEYINIT_DISABLE_KERNELS=1`` to force the reference implementation.
"""

from __future__ import annotations

from keyinit._draw.dispatch import KernelRef, register_kernel

__all__ = ["register"]

#: Stream v1's kernels: (family, device type, module, function).
_V1 = (
    ("fill", "cpu", "keyinit._kernels.fill.cpu", "fill"),
    ("fill", "cuda", "keyinit._kernels.fill.triton", "fill"),
    ("dropout", "cpu", "keyinit._kernels.dropout.cpu", "run"),
    ("dropout", "cuda", "keyinit._kernels.dropout.triton", "run"),
    ("permutation", "cpu", "keyinit._kernels.permutation.cpu", "run"),
    ("permutation", "cuda", "keyinit._kernels.permutation.triton", "run"),
    ("sround", "cpu", "keyinit._kernels.fill.cpu", "sround"),
    ("sround", "cuda", "keyinit._kernels.fill.triton_sround", "sround"),
    ("sround_fp4", "cpu", "keyinit._kernels.fill.cpu", "sround_fp4"),
    ("sround_fp4", "cuda", "keyinit._kernels.fill.triton_sround", "sround_fp4"),
    ("sround_adam", "cpu", "keyinit._kernels.fill.cpu", "sround_adam"),
    ("sround_adam", "cuda", "keyinit._kernels.fill.triton_sround", "sround_adam"),
    ("sround_many", "cuda", "keyinit._kernels.fill.triton_sround_many", "sround_many"),
    ("sround_adam_many", "cuda", "keyinit._kernels.fill.triton_sround_many", "sround_adam_many"),
)


#: Stream v2's fill kernels, which also draw a keyed forward's random ops by extent-free names
#: (keyinit._draw.names.naming); its other kernels are v1's (its names are a geometry's high words).
_V2_FILL = (
    ("fill", "cpu", "keyinit._kernels.fill.cpu", "fill_v2"),
    ("fill", "cuda", "keyinit._kernels.fill.triton", "fill_v2"),
)


def register() -> None:
    """Register stream v1's and v2's kernels in :data:`keyinit._draw.dispatch.KERNELS` (again: no change).
    Each is named by module and imported on its first call."""
    for family, device, module, name in _V1:
        register_kernel("v1", family, device, KernelRef(module, name))
        if family != "fill":
            register_kernel("v2", family, device, KernelRef(module, name))
    for family, device, module, name in _V2_FILL:
        register_kernel("v2", family, device, KernelRef(module, name))
