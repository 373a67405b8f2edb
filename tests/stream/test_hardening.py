"""Bad or unusual inputs never segfault, never give wrong values, never cost unbounded memory.

- hand-built ``Region`` objects are validated (int64, CPU, in bounds);
- a default device of ``meta`` (``torch.set_default_device`` / ``with torch.device``)
  cannot turn keyinit's internal index tensors into meta tensors;
- ``out`` that overlaps itself is refused; views with torch's negative bit are
  written with the right sign;
- lazy regions: a slice costs no index memory, so huge shapes fail at once or
  cost only their output;
- host-side binary32 rounding does not depend on the process's flush-to-zero mode.
"""

from __future__ import annotations

import json
import math
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import keyinit
from keyinit._draw import reference_fill
from keyinit import random as kr
from keyinit._bits.fp32math import f32
from keyinit.distributions import Normal
from keyinit.regions import Region, make_region

try:  # tests/ as a package or as a plain directory
    from tests.conftest import assert_bits_equal
except ImportError:
    from conftest import assert_bits_equal

REPO = Path(__file__).resolve().parents[2]
K = keyinit.key(7)


# ---------------------------------------------------------------- hand-built regions


def test_hand_built_region_converts_integer_index_dtypes_exactly():
    expected = kr.normal(K, (6, 5), region=([5, 0, 3], slice(None)))
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        region = Region((6, 5), (torch.tensor([5, 0, 3], dtype=dtype), slice(None)))
        assert region.entries[0].dtype == torch.int64 and region.entries[0].device.type == "cpu"
        assert_bits_equal(kr.normal(K, (6, 5), region=region), expected)
    negative = Region((6, 5), (torch.tensor([-1, 0, -3], dtype=torch.int32), range(5)))
    assert negative.entries[0].tolist() == [5, 0, 3] and negative.entries[1] == range(5)


@pytest.mark.parametrize("entry, exception, message", [
    (torch.tensor([0.0, 1.0]), TypeError, "region entry 0 must be a 1-D integer tensor, got a 1-D torch.float32 tensor"),
    (torch.tensor([True]), TypeError, "region entry 0 must be a 1-D integer tensor, got a 1-D torch.bool tensor"),
    (torch.empty(2, dtype=torch.int64, device="meta"), ValueError,
     "region entry 0 is a meta tensor: its indices have no values; pass the indices on the CPU"),
    (torch.tensor([6]), IndexError, "region entry 0 has index 6, out of bounds for size 6"),
    (torch.tensor([-7], dtype=torch.int32), IndexError, "region entry 0 has index -7, out of bounds for size 6"),
    (torch.tensor([2**63 + 5], dtype=torch.uint64), IndexError,
     f"region entry 0 has index {2**63 + 5}, out of bounds for size 6"),
    (range(0, 7), IndexError, "region entry 0 has index 6, out of bounds for size 6"),
])
def test_hand_built_region_refuses_bad_indices(entry, exception, message):
    with pytest.raises(exception, match="^" + __import__("re").escape(message) + "$"):
        Region((6, 5), (entry, slice(None)))


def test_hand_built_region_checks_its_shape_and_entry_count():
    with pytest.raises(ValueError, match=r"region has 1 entries but the shape \(6, 5\) has 2 dimensions"):
        Region((6, 5), (slice(None),))
    with pytest.raises(ValueError, match="non-negative"):
        Region((6, -1), (slice(None), slice(None)))
    assert Region(shape=(3,), indices=(slice(None),)).entries == (range(3),)  # keyword form
    empty_meta = Region((4,), (torch.empty(0, dtype=torch.int64, device="meta"),))
    assert empty_meta.entries == (range(0),) and empty_meta.region_shape == (0,)


def test_region_owns_its_indices():
    mine = torch.tensor([4, 1, 2])
    region = Region((6,), (mine,))
    before = kr.bits(K, (6,), region=region)
    mine[0] = 10**6  # the caller's tensor
    region.indices[0][1] = 10**6  # the copy handed out by .indices
    assert torch.equal(kr.bits(K, (6,), region=region), before)
    assert region.indices[0].tolist() == [4, 10**6, 2]  # (that copy is cached, and was changed)


def test_slices_ranges_and_progressions_stay_lazy():
    region = make_region((10, 2**40), (slice(None, None, -3), [7, 9, 11]))
    assert region.entries == (range(9, -1, -3), range(7, 13, 2)) and region.is_range(0) and region.is_range(1)
    assert region.region_shape == (4, 3) and region.indices[0].tolist() == [9, 6, 3, 0]
    assert make_region((10,), (range(-3, 0),)).entries == (range(7, 10),)
    mixed = make_region((10,), (range(-1, 2),)).entries[0]
    assert isinstance(mixed, torch.Tensor) and mixed.tolist() == [9, 0, 1]
    assert make_region((10,), ([4],)).entries == (range(4, 5),)
    assert make_region((5,), ([],)).entries == (range(0),)
    listed = make_region((10,), ([1, 2, 4],)).entries[0]
    assert isinstance(listed, torch.Tensor) and not make_region((10,), ([1, 2, 4],)).is_range(0)


def test_huge_shapes_fail_at_once_instead_of_building_index_vectors():
    # 2**62 elements: the output cannot be allocated, and nothing else was attempted first
    with pytest.raises(RuntimeError):
        kr.normal(K, (2**31, 2**31))
    region = make_region((2**31, 2**31), None)
    assert region.entries == (range(2**31), range(2**31)) and region.numel == 2**62


_PEAK_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import keyinit
from keyinit import random as kr
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
kr.normal(keyinit.key(0), (64, 64))  # load the kernel
base = peak()
out = kr.normal(keyinit.key(0), (1 << 24,))
print(json.dumps({"growth": peak() - base, "output": out.numel() * out.element_size()}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux) for peak RSS")
def test_full_1d_draw_costs_its_output_and_a_bounded_workspace():
    proc = subprocess.run([sys.executable, "-c", _PEAK_CHILD, str(REPO)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the output is 64 MiB; an int64 index vector of the dim alone would be 128 MiB more
    assert result["growth"] < result["output"] + 16 * 2**20, result


# ---------------------------------------------------------------- meta default device


def test_samplers_under_a_meta_default_device():
    outside = {name: fn() for name, fn in _draws().items()}
    with torch.device("meta"):
        assert kr.normal(K, (8, 8)).device.type == "meta"  # like torch.randn: the default device
        inside = {name: fn() for name, fn in _draws().items()}
        out = torch.empty(8, 8, device="cpu")
        kr.normal(K, (8, 8), out=out)
    for name in outside:
        assert inside[name].device.type == "cpu"
        assert_bits_equal(inside[name], outside[name])
    assert_bits_equal(out, outside["normal"])
    torch.set_default_device("meta")
    try:
        again = {name: fn() for name, fn in _draws().items()}
    finally:
        torch.set_default_device(None)
    for name in outside:
        assert_bits_equal(again[name], outside[name])


def _draws():
    return {
        "normal": lambda: kr.normal(K, (8, 8), device="cpu"),
        "region": lambda: kr.uniform(K, (9, 7), region=([8, 1, 1], slice(None, None, -2)), device="cpu"),
        "tensor_region": lambda: kr.bits(K, (9,), region=(torch.tensor([3, 4, 0], device="cpu"),), device="cpu"),
        "trunc": lambda: kr.truncated_normal(K, (300,), a=-0.5, b=3.0, dtype=torch.bfloat16, device="cpu"),
        "randint": lambda: kr.randint(K, (5, 5), low=-3, high=9, device="cpu"),
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Conv2d(3, 4, 3), nn.MultiheadAttention(16, 2),
                         nn.Bilinear(3, 4, 5))


def test_init_model_under_a_meta_default_device_on_a_cpu_model():
    expected = _model()
    keyinit.init_model(expected, seed=11)
    model = _model()
    with torch.device("meta"):
        keyinit.init_model(model, seed=11)
    for (name, a), b in zip(expected.state_dict().items(), model.state_dict().values()):
        assert b.device.type == "cpu", name
        assert_bits_equal(b, a)


_META_FIRST_LOAD_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import keyinit
from keyinit._kernels.fill import cpu as _cpu
torch.set_default_device("meta")
x = keyinit.random.normal(keyinit.key(0), (8, 8), device="cpu")   # first use: build, load, self-test
torch.set_default_device(None)
assert _cpu.available(), _cpu.failure_reason()
assert torch.equal(x, keyinit.random.normal(keyinit.key(0), (8, 8)))
print("ok")
"""


def test_kernel_first_loaded_under_a_meta_default_device(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _META_FIRST_LOAD_CHILD, str(REPO)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, KEYINIT_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("which", ["padding_idx", "dirac"])
def test_init_py_rules_under_a_meta_default_device(which):
    if which == "padding_idx":
        def make():
            return nn.Embedding(10, 4, padding_idx=3)
        rules = None
    else:
        def make():
            return nn.Conv2d(4, 4, 3)
        rules = {"weight": keyinit.init.dirac()}
    expected = make()
    keyinit.init_model(expected, seed=2, rules=rules)
    model = make()
    with torch.device("meta"):
        keyinit.init_model(model, seed=2, rules=rules)
    assert torch.equal(model.weight, expected.weight)


# ---------------------------------------------------------------- out=


def test_out_overlapping_itself_is_refused():
    storage = torch.zeros(20)
    with pytest.raises(ValueError, match=r"out has overlapping memory \(its strides \(1, 2\) map two elements"):
        kr.normal(K, (3, 3), out=storage.as_strided((3, 3), (1, 2)))
    assert bool((storage == 0).all())  # nothing written


def test_out_with_unusual_but_disjoint_strides_is_filled():
    storage = torch.full((20,), -1.0)
    out = storage.as_strided((3, 2), (3, 5))  # offsets 0 3 6 5 8 11: disjoint, though 5 < 2 * 3
    kr.normal(K, (3, 2), out=out)
    assert_bits_equal(out.contiguous(), kr.normal(K, (3, 2)))


def test_sparse_out_is_refused():
    with pytest.raises(TypeError, match="out must be a dense"):
        kr.normal(K, (3,), out=torch.zeros(3).to_sparse())


@pytest.mark.parametrize("complex_dtype", [torch.complex64, torch.complex128])
def test_negative_bit_views_get_the_values_not_their_negation(complex_dtype):
    z = torch.zeros(2, 50, dtype=complex_dtype)
    target = z.conj().imag  # torch's negative bit: reads storage negated
    assert target.is_neg()
    dtype = target.dtype
    kr.normal(K, (2, 50), dtype=dtype, out=target)
    assert_bits_equal(target.resolve_neg(), kr.normal(K, (2, 50), dtype=dtype))
    neg = torch._neg_view(torch.zeros(40))
    kr.uniform(K, (40,), low=-1.0, high=1.0, out=neg)
    assert_bits_equal(neg.resolve_neg(), kr.uniform(K, (40,), low=-1.0, high=1.0))


def test_meta_outputs_compute_nothing():
    calls = []
    original = reference_fill.fill
    try:
        reference_fill.fill = lambda *a, **k: (calls.append(1), original(*a, **k))
        with torch.device("meta"):
            out = kr.normal(K, (4, 4))
    finally:
        reference_fill.fill = original
    assert out.device.type == "meta" and calls == []


# ---------------------------------------------------------------- host rounding


def test_f32_is_round_to_nearest_even_without_the_fpu():
    rnd = random.Random(5)
    values = [0.0, -0.0, 1e-40, 2.0**-149, 2.0**-150, 3 * 2.0**-151, 2.0**-126, 3.4028235677973366e38, math.inf]
    values += [rnd.choice((-1, 1)) * 2.0**rnd.uniform(-155, 128) for _ in range(20000)]
    for value in values:
        try:
            expected = struct.unpack("<f", struct.pack("<f", value))[0]
        except OverflowError:
            with pytest.raises(OverflowError):
                f32(value)
            continue
        got = f32(value)
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected), value


_FTZ_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_flush_denormal(True)
from keyinit.distributions import Uniform, TruncatedNormal
u = Uniform.create(0.0, 1e-40)
t = TruncatedNormal.create(0.0, 1.0, -14.0, -13.0, torch.float32)
print(repr((u.span, t.p_low)))
"""


def test_distribution_parameters_do_not_depend_on_flush_to_zero():
    proc = subprocess.run([sys.executable, "-c", _FTZ_CHILD, str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from keyinit.distributions import TruncatedNormal, Uniform

    expected = (Uniform.create(0.0, 1e-40).span,
                TruncatedNormal.create(0.0, 1.0, -14.0, -13.0, torch.float32).p_low)
    assert 0.0 < expected[0] < 2.0**-126 and 0.0 < expected[1] < 2.0**-126
    assert proc.stdout.strip() == repr(expected)


def test_normal_default_dtype_unchanged():
    # the distribution value objects are unchanged by the software rounding
    assert Normal.create(0.1, 0.02) == Normal(f32(0.1), f32(0.02))
