"""Samplers: any region of a keyed random tensor, bit-for-bit.

Every sampler takes the key, the GLOBAL ``shape`` and an optional ``region``
(see :mod:`keyinit.regions`) and returns ``full[region]``, where ``full`` is
the tensor that drawing the whole shape would give. Only the region's elements
are computed. Element ``i`` (row-major global flat index) of the full tensor
depends only on the key, the distribution's parameters, the dtype and ``i``.

Common keyword arguments:

- ``dtype``: output dtype (each sampler lists what it supports);
- ``device``: where the result is allocated (ignored when ``out`` is given);
- ``region``: one entry per dimension (slice, int sequence or 1-D int tensor);
- ``out``: an existing tensor of the region's shape and the dtype to write into.

No sampler reads or changes the global torch RNG.

:func:`stochastic_round` is not a sampler but uses the same words: it rounds a float32/float64
tensor that holds ``full[region]`` to a narrower float dtype, element ``i`` rounded up with the
probability of its distance from its lower neighbour, decided by word ``i`` of the key's stream.
:func:`stochastic_round_words` is its form for ``torch.compile``: the key as a tensor input
(:func:`key_words`), plain torch integer operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch

from keyinit._bits.philox import stream_words
from keyinit._bits.sround import TARGETS, check_round_input, round_bits, to_dtype
from keyinit._draw import dispatch
from keyinit.distributions import (
    Bernoulli,
    Bits,
    Distribution,
    Normal,
    Randint,
    TruncatedNormal,
    Uniform,
)
from keyinit.keys import Key, require_key, as_int
from keyinit.layouts import dtensor_class, target_for
from keyinit.regions import RegionEntry, make_region, normalize_shape

__all__ = ["bits", "uniform", "normal", "truncated_normal", "bernoulli", "randint", "sample", "stochastic_round",
           "stochastic_round_fp4", "stochastic_round_words", "key_words", "ROUND_SOURCES", "ROUND_TARGETS"]

ShapeLike = Union[Sequence[int], torch.Size, int]
DeviceLike = Union[torch.device, str, None]
RegionLike = Optional[Sequence[RegionEntry]]


def sample(
    dist: Distribution,
    key: Key,
    shape: ShapeLike,
    *,
    dtype: Optional[torch.dtype] = None,
    device: DeviceLike = None,
    region: RegionLike = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Draw ``full[region]`` of distribution ``dist`` (a :mod:`keyinit.distributions` value)."""
    key = require_key(key)
    shape = normalize_shape(shape)
    dtype = _resolve_dtype(dtype, out, dist.dtypes[0])
    dist.check_dtype(dtype)
    normalized = make_region(shape, region)
    if out is None:
        out = torch.empty(normalized.region_shape, dtype=dtype, device=device)
    else:
        _check_out(out, normalized.region_shape, dtype)
    with torch.no_grad():
        dispatch.fill(out, dist, key, normalized)
    return out


def _resolve_dtype(dtype: Optional[torch.dtype], out: Optional[torch.Tensor], default: torch.dtype) -> torch.dtype:
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if dtype is not None:
        return dtype
    return out.dtype if out is not None else default


def _check_out(out: torch.Tensor, region_shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != region_shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but the region has shape {region_shape}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype} but dtype={dtype} was requested")
    if out.layout != torch.strided:
        raise TypeError(f"out must be a dense (strided) tensor, got layout {out.layout}")
    if out.device.type == "meta":
        raise ValueError("out is on the meta device; materialize it first (e.g. with to_empty)")
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise ValueError("out has overlapping memory (a zero stride); write into a tensor that owns its elements")
    if _may_overlap(out):
        raise ValueError(
            f"out has overlapping memory (its strides {tuple(out.stride())} map two elements of shape "
            f"{tuple(out.shape)} to the same storage); write into a tensor that owns its elements"
        )


#: Above this many elements, strides that the quick rule cannot clear are refused without an exact check.
_EXACT_OVERLAP_LIMIT = 1 << 22


def _may_overlap(out: torch.Tensor) -> bool:
    """True when two elements of ``out`` share storage (or, past a size limit, might).

    Quick rule: sorted by stride, each dimension's stride must exceed the span of
    all smaller-stride dimensions; every tensor torch makes passes it. Strides
    that fail it (only ``as_strided`` makes them) are settled exactly by listing
    the offsets, up to :data:`_EXACT_OVERLAP_LIMIT` elements.
    """
    dims = sorted((stride, size) for size, stride in zip(out.shape, out.stride()) if size > 1)
    span = 0
    for stride, size in dims:
        if stride <= span:
            break
        span += (size - 1) * stride
    else:
        return False
    if out.numel() > _EXACT_OVERLAP_LIMIT:
        return True
    offsets = torch.zeros((), dtype=torch.int64, device="cpu")
    for size, stride in zip(out.shape, out.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64, device="cpu") * stride
    flat = offsets.reshape(-1)
    return int(torch.unique(flat).numel()) != int(flat.numel())


def bits(key: Key, shape: ShapeLike, *, dtype: Optional[torch.dtype] = None, device: DeviceLike = None,
         region: RegionLike = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Raw 32-bit stream words as int64 in ``[0, 2**32)``: element ``i`` is word ``i``.

    ``bits(key(0), (4,))`` is the first Random123 known-answer vector. dtype: int64.
    """
    return sample(Bits(), key, shape, dtype=dtype, device=device, region=region, out=out)


def uniform(key: Key, shape: ShapeLike, *, low: float = 0.0, high: float = 1.0,
            dtype: Optional[torch.dtype] = None, device: DeviceLike = None,
            region: RegionLike = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Uniform on ``[low, high)``: ``low + (high - low) * u`` with 24-bit ``u`` in ``[0, 1)``.

    Computed in float32, then rounded to ``dtype`` (float32, float64, bfloat16,
    float16); rounding can produce ``high`` itself.
    """
    return sample(Uniform.create(low, high), key, shape, dtype=dtype, device=device, region=region, out=out)


def normal(key: Key, shape: ShapeLike, *, mean: float = 0.0, std: float = 1.0,
           dtype: Optional[torch.dtype] = None, device: DeviceLike = None,
           region: RegionLike = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Normal ``N(mean, std**2)`` by inversion of the CDF (tails reach about 6.3 std).

    Computed in float32, then rounded to ``dtype`` (float32, float64, bfloat16, float16).
    """
    return sample(Normal.create(mean, std), key, shape, dtype=dtype, device=device, region=region, out=out)


def truncated_normal(key: Key, shape: ShapeLike, *, mean: float = 0.0, std: float = 1.0,
                     a: float = -2.0, b: float = 2.0, dtype: Optional[torch.dtype] = None,
                     device: DeviceLike = None, region: RegionLike = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``N(mean, std**2)`` truncated to the absolute bounds ``[a, b]``, as ``nn.init.trunc_normal_``.

    Drawn by inversion with one stream word per element: it never loops, for
    any bounds, and every value lies in ``[a, b]``.
    """
    resolved = _resolve_dtype(dtype, out, torch.float32)
    dist = TruncatedNormal.create(mean, std, a, b, resolved)
    return sample(dist, key, shape, dtype=resolved, device=device, region=region, out=out)


def bernoulli(key: Key, shape: ShapeLike, *, p: float = 0.5, dtype: Optional[torch.dtype] = None,
              device: DeviceLike = None, region: RegionLike = None,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """True with probability ``round(p * 2**32) / 2**32``. dtype: bool (default), float or int."""
    return sample(Bernoulli.create(p), key, shape, dtype=dtype, device=device, region=region, out=out)


def _integer(value: object, name: str) -> object:
    """Integer scalars ``key()`` accepts (numpy ints, 0-d int tensors) as ints; anything else unchanged."""
    try:
        return as_int(value, f"randint: {name}")
    except TypeError:
        return value  # Randint.create names what is wrong


def randint(key: Key, shape: ShapeLike, *, low: int, high: int, dtype: Optional[torch.dtype] = None,
            device: DeviceLike = None, region: RegionLike = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Integers in ``[low, high)`` with ``high - low <= 2**32``; two words per element, bias below ``2**-32``.

    dtype: int64 (default), int32, int16, int8, uint8; the range must fit it.
    """
    resolved = _resolve_dtype(dtype, out, torch.int64)
    low, high = (_integer(value, name) for value, name in ((low, "low"), (high, "high")))
    dist = Randint.create(low, high, resolved)
    return sample(dist, key, shape, dtype=resolved, device=device, region=region, out=out)


#: The dtypes :func:`stochastic_round` rounds from, and to (``docs/spec.md`` section 17).
ROUND_SOURCES = (torch.float32, torch.float64)
ROUND_TARGETS = tuple(TARGETS)


def stochastic_round(key: Key, x: torch.Tensor, dtype: torch.dtype, *, global_shape: Optional[ShapeLike] = None,
                     region: RegionLike = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (float32 or float64) rounded stochastically to ``dtype`` (bfloat16, float16,
    float8_e5m2, float8_e4m3fn), keyed by ``key`` and each element's global index.

    Each value goes to one of its two neighbours in ``dtype``: up (in magnitude) with probability
    ``R / 2**32``, ``R = floor(2**32 * (|v| - lo) / (hi - lo))``, decided by stream word ``i`` of
    ``key`` for the element of global flat index ``i`` (``docs/spec.md`` section 17): so
    ``E[result] = x`` up to ``2**-32`` of a step, representable values, zeros and NaN stay, and
    overflow is ``inf`` (``float8_e4m3fn``, which has none: its largest finite value).

    - a plain ``x`` is ``full[region]`` of a ``global_shape`` tensor, as for the samplers
      (default: the whole tensor, ``global_shape = x.shape``);
    - a DTensor ``x`` takes its global shape and region from its placements (Shard,
      ``_StridedShard``, Replicate; Partial is an error) and gives a DTensor of the same
      placements, with no communication.

    ``out``: a tensor of ``x``'s (local) shape and ``dtype`` to write into, returned (the in-place
    form; with a DTensor ``x``, a DTensor of the same placements or a plain local tensor). Integer operations on the bit patterns
    only: the same bits on every device. Never reads the global RNG.
    """
    key = require_key(key)
    check_round_input("stochastic_round", x, dtype)
    local, normalized, dtensor = _round_target(x, global_shape, region)
    if out is None:
        out_local = torch.empty(local.shape, dtype=dtype, device=local.device)
    else:
        out_local = out
        if dtensor is not None and isinstance(out, type(dtensor)):
            if tuple(out.placements) != tuple(dtensor.placements) or out.shape != dtensor.shape:
                raise ValueError(f"stochastic_round: out is a DTensor of shape {tuple(out.shape)} and placements "
                                 f"{tuple(out.placements)}, x one of shape {tuple(dtensor.shape)} and placements "
                                 f"{tuple(dtensor.placements)}; they must agree")
            out_local = out.to_local()
        _check_out(out_local, normalized.region_shape, dtype)
    if local.numel() and local.device.type != "meta":
        with torch.no_grad():
            dispatch.sround(out_local, local, key, normalized)
    return _rounded(out, out_local, dtensor)


def _rounded(out: Optional[torch.Tensor], out_local: torch.Tensor, dtensor: Any) -> torch.Tensor:
    """What a rounding returns: the caller's ``out``; else ``out_local``, as a DTensor of ``dtensor``'s
    placements when the input was one (no communication)."""
    if out is not None:
        return out
    if dtensor is not None:
        spec = dtensor._spec
        return type(dtensor).from_local(out_local, spec.mesh, spec.placements, run_check=False,
                                        shape=dtensor.shape, stride=dtensor.stride())
    return out_local


def _round_target(x: torch.Tensor, global_shape: Optional[ShapeLike], region: RegionLike):
    """``(local tensor, its Region, the DTensor or None)`` of :func:`stochastic_round`'s input."""
    cls = None if type(x) in (torch.Tensor, torch.nn.Parameter) else dtensor_class()
    if cls is not None and isinstance(x, cls):
        if global_shape is not None or region is not None:
            raise TypeError("stochastic_round: a DTensor's global shape and region come from its placements; "
                            "pass global_shape/region only with a plain local tensor")
        found = target_for(x, fqn="stochastic_round: x", module=torch.nn.Module(), name="x")
        return found.out, found.region, x
    if global_shape is None:
        if region is not None:
            raise TypeError("stochastic_round: a region needs the global_shape it is a region of")
        global_shape = x.shape
    normalized = make_region(normalize_shape(global_shape), region)
    if normalized.region_shape != tuple(x.shape):
        raise ValueError(f"stochastic_round: x has shape {tuple(x.shape)} but the region of global shape "
                         f"{normalized.shape} has shape {normalized.region_shape}")
    return x, normalized, None


def stochastic_round_fp4(key: Key, x: torch.Tensor, scale: Union[torch.Tensor, float], *,
                         global_shape: Optional[ShapeLike] = None, region: RegionLike = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x / scale`` rounded stochastically to FP4 E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
    negatives), keyed like :func:`stochastic_round` (``docs/spec.md`` 17.7): the MX/NVFP4 element
    format, given the scale the caller computed (an E8M0 or E4M3 block scale broadcast to ``x``'s
    shape, times NVFP4's per-tensor scale, as a tensor or a number).

    ``x``: float32 or float64 (a plain tensor holding ``full[region]`` of ``global_shape``, or a DTensor);
    ``scale``: a number or a tensor broadcastable to ``x``'s (local) shape, on its device. The quotient
    is taken in float64 (exact for power-of-two scales), then rounded by section 17.2 with E2M1's
    ``p = 2``, ``emin = 0``, ``emax = 2``; overflow and infinities saturate to 6 (sign kept), a NaN
    quotient (NaN input, ``0 / 0``) is a ``ValueError``.

    Returns uint8 codes of ``x``'s (local) shape, one element each, the 4-bit E2M1 code (sign bit 3) in
    the low bits: torchao's unpacked layout (``f32_to_f4_unpacked``), to be packed two per byte as the
    consumer wants (torchao's ``pack_uint4``; ``torch.float4_e2m1fn_x2``). ``out``: uint8, that shape.
    """
    key = require_key(key)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"stochastic_round_fp4: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ROUND_SOURCES:
        raise TypeError(f"stochastic_round_fp4: x must be float32 or float64, got {x.dtype}")
    local, normalized, dtensor = _round_target(x, global_shape, region)
    if out is None:
        out_local = torch.empty(local.shape, dtype=torch.uint8, device=local.device)
    else:
        out_local = out.to_local() if dtensor is not None and isinstance(out, type(dtensor)) else out
        _check_out(out_local, normalized.region_shape, torch.uint8)
    if isinstance(scale, torch.Tensor):
        if scale.device != local.device:
            raise ValueError(f"stochastic_round_fp4: scale is on {scale.device}, x on {local.device}")
        scale64 = scale.detach().to(torch.float64)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale64 = torch.tensor(float(scale), dtype=torch.float64, device=local.device)
    else:
        raise TypeError(f"stochastic_round_fp4: scale must be a number or a tensor, got {type(scale).__name__}")
    try:
        v = torch.broadcast_to(local.detach().to(torch.float64) / scale64, local.shape)
    except RuntimeError:
        raise ValueError(f"stochastic_round_fp4: scale of shape {tuple(scale64.shape)} does not broadcast to "
                         f"x's local shape {tuple(local.shape)}") from None
    if local.numel() and local.device.type != "meta":
        if bool(torch.isnan(v).any()):
            raise ValueError("stochastic_round_fp4: x / scale has NaN elements (a NaN in x or scale, or 0 / 0); "
                             "E2M1 has no NaN")
        with torch.no_grad():
            dispatch.sround_fp4(out_local, v, key, normalized)
    return _rounded(out, out_local, dtensor)


def key_words(key: Key, *, device: DeviceLike = None) -> torch.Tensor:
    """``key``'s two 32-bit words as an int64 tensor of shape ``(2,)``: the key of
    :func:`stochastic_round_words`, passed to a compiled function as a tensor input (a new key is a new
    value, not a recompile)."""
    key = require_key(key)
    if key.impl.words is not stream_words:
        raise ValueError(f"key_words: the key's stream {key.impl.name!r} does not draw its element words with "
                         "Philox4x32-10 (docs/spec.md section 4); stochastic_round_words cannot stand in for it")
    return torch.tensor(key.words, dtype=torch.int64, device=device)


def stochastic_round_words(words: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, *,
                           global_shape: Optional[ShapeLike] = None, region: RegionLike = None) -> torch.Tensor:
    """:func:`stochastic_round` with the key given as ``key_words(key)``: bitwise its values, computed with
    plain torch integer operations, so ``torch.compile`` traces it into the graph (no graph break) and the
    key is a tensor input (one compiled graph for every step's key).

    ``words``: an int64 tensor of shape ``(2,)`` on ``x``'s device (:func:`key_words`). ``x``: a plain
    float32/float64 tensor holding ``full[region]`` of ``global_shape`` (a DTensor: pass its local tensor,
    its global shape and its region, :func:`keyinit.layouts.target_for`; under ``torch.compile`` a region's
    indices are computed outside the graph: a graph break, so ``fullgraph=True`` takes whole tensors only).
    Returns a new tensor of ``x``'s shape and ``dtype``. Its temporaries are int64 tensors of ``x``'s size
    (the compiled kernels fuse them).
    """
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int64 or tuple(words.shape) != (2,):
        raise TypeError("stochastic_round_words: words must be an int64 tensor of shape (2,) (key_words(key)), got "
                        + (f"{words.dtype} of shape {tuple(words.shape)}" if isinstance(words, torch.Tensor)
                           else type(words).__name__))
    if not isinstance(x, torch.Tensor) or type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"stochastic_round_words: x must be a plain torch.Tensor (a DTensor's local tensor with its "
                        f"global_shape and region), got {type(x).__name__}")
    if x.dtype not in ROUND_SOURCES:
        raise TypeError(f"stochastic_round_words: x must be float32 or float64, got {x.dtype}")
    if dtype not in ROUND_TARGETS:
        names = ", ".join(str(d) for d in ROUND_TARGETS)
        raise TypeError(f"stochastic_round_words: dtype must be one of {names}, got {dtype}")
    if words.device != x.device:
        raise ValueError(f"stochastic_round_words: words are on {words.device}, x on {x.device}")
    if global_shape is None and region is None:
        index = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    else:
        index = _region_index(x, global_shape, region)
    (word,) = stream_words((words[0], words[1]), index, 1)
    return to_dtype(round_bits(x.detach().reshape(-1), word, TARGETS[dtype]), dtype).reshape(x.shape)


# torch._disable_dynamo, not torch.compiler.disable: the same graph break, but torch._dynamo (and with it
# triton, ~0.3 s) is imported at the first call, not when keyinit is imported.
@torch._disable_dynamo
def _region_index(x: torch.Tensor, global_shape: Optional[ShapeLike], region: RegionLike) -> torch.Tensor:
    """The global flat indices of ``x``'s elements, ``full[region]`` of ``global_shape`` (outside any graph)."""
    _, normalized, _ = _round_target(x, global_shape, region)
    return normalized.flat_indices(0, normalized.numel).to(x.device)
