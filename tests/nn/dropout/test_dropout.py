"""keyinit.nn.functional.dropout: the contract, autograd, saved memory, torch.compile, imports.

Expected values are built from the public sampler, independently of the op:
``keep = keyinit.random.bernoulli(key, global_shape, p=1 - p, region=region)``
and ``keep ? x * scale : +0`` with the per-dtype arithmetic of docs/spec.md
section 14 (binary32 product for 16-bit dtypes, then rounded).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import keyinit
from keyinit.nn import dropout_key
from keyinit.nn import functional as KF

try:
    from tests.conftest import assert_bits_equal, bit_view
except ImportError:  # pragma: no cover - tests/ as a plain directory
    from conftest import assert_bits_equal, bit_view

K = dropout_key(7, step=3, fqn="layers.1.attention", ordinal=0)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
PS = (1e-9, 0.1, 0.5, 0.9, 1 - 1e-9)


def expected(x: torch.Tensor, p: float, key=K, global_shape=None, region=None) -> torch.Tensor:
    shape = tuple(x.shape) if global_shape is None else tuple(global_shape)
    keep = keyinit.random.bernoulli(key, shape, p=1 - p, region=region)
    if x.dtype == torch.float64:
        kept = x * (1.0 / (1.0 - p))
    else:
        kept = (x.float() * torch.tensor(1.0 / (1.0 - p), dtype=torch.float32)).to(x.dtype)
    return torch.where(keep, kept, torch.zeros((), dtype=x.dtype))


def data(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", PS)
def test_contract_each_p_and_dtype(dtype, p):
    x = data((6, 33, 17), dtype)
    assert_bits_equal(KF.dropout(x, p, rng_key=K), expected(x, p))


def test_p0_training_false_and_p1():
    x = data((5, 8))
    assert KF.dropout(x, 0.0, rng_key=K) is x
    assert KF.dropout(x, 0.5, rng_key=K, training=False) is x
    x = x.requires_grad_()
    zeros = KF.dropout(x, 1.0, rng_key=K)
    assert torch.equal(bit_view(zeros), torch.zeros(5, 8, dtype=torch.int32))  # +0, not -0
    zeros.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_dropped_elements_are_plus_zero_and_kept_nan_stays_nan():
    x = torch.tensor([float("nan"), float("inf"), -1.0, float("-inf")] * 64)
    y = KF.dropout(x, 0.5, rng_key=K)
    keep = keyinit.random.bernoulli(K, x.shape, p=0.5)
    assert torch.equal(bit_view(y[~keep]), torch.zeros(int((~keep).sum()), dtype=torch.int32))
    assert torch.isnan(y[keep & torch.isnan(x)]).all()
    assert torch.equal(y[keep & ~torch.isnan(x)], x[keep & ~torch.isnan(x)] * 2)


@pytest.mark.parametrize("region", [
    (slice(2, 5), slice(None), slice(3, 11)),
    (slice(None, None, -2), [0, 8, 4, 4], slice(1, None, 3)),
    (torch.tensor([6, 0]), slice(5, 9), [10]),
], ids=["slices", "steps-and-lists", "tensor-index"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_regions_of_a_global_tensor(region, dtype):
    shape = (7, 9, 12)
    local_shape = keyinit.regions.make_region(shape, region).region_shape
    x = data(local_shape, dtype, seed=1)
    assert_bits_equal(KF.dropout(x, 0.3, rng_key=K, global_shape=shape, region=region), expected(x, 0.3, K, shape, region))


def test_tiles_reassemble_the_whole_and_non_contiguous_inputs():
    x = data((10, 24))
    whole = KF.dropout(x, 0.4, rng_key=K)
    tiles = [[KF.dropout(x[r:r + 5, c:c + 8].contiguous(), 0.4, rng_key=K, global_shape=(10, 24),
                         region=(slice(r, r + 5), slice(c, c + 8))) for c in (0, 8, 16)] for r in (0, 5)]
    assert torch.equal(torch.cat([torch.cat(row, 1) for row in tiles], 0), whole)
    t = data((24, 10)).t()  # non-contiguous input: same values as its contiguous copy
    assert torch.equal(KF.dropout(t, 0.4, rng_key=K), KF.dropout(t.contiguous(), 0.4, rng_key=K))


def test_mask_frequency_and_indices_near_2_62():
    x = torch.ones(200_000)
    kept = float((KF.dropout(x, 0.3, rng_key=K) != 0).float().mean())
    assert abs(kept - 0.7) < 0.005
    shape, region = (2**31, 2**31), (slice(2**31 - 3, None), slice(2**31 - 50, None))
    x = data((3, 50))
    assert torch.equal(KF.dropout(x, 0.5, rng_key=K, global_shape=shape, region=region), expected(x, 0.5, K, shape, region))


def test_bad_arguments_are_clear_errors():
    x = data((4, 4))
    with pytest.raises(ValueError, match="between 0 and 1"):
        KF.dropout(x, 1.5, rng_key=K)
    with pytest.raises(TypeError, match="dropout probability must be a float"):
        KF.dropout(x, True, rng_key=K)
    with pytest.raises(TypeError, match="^rng_key must be a keyinit.Key"):
        KF.dropout(x, 0.5, rng_key=7)
    # one argument convention: torch's arguments in torch's order, the key keyword-only (as for attention)
    with pytest.raises(TypeError, match="positional"):
        KF.dropout(x, 0.5, K)
    with pytest.raises(TypeError, match="positional"):
        dropout_key(0, 3, "a", 0)
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16, got torch.int64"):
        KF.dropout(torch.ones(3, dtype=torch.long), 0.5, rng_key=K)
    with pytest.raises(ValueError, match=r"region of global shape \(8, 4\) has shape \(3, 4\), but the input has"):
        KF.dropout(x, 0.5, rng_key=K, global_shape=(8, 4), region=(slice(0, 3), slice(None)))
    with pytest.raises(ValueError, match="pass the region"):
        KF.dropout(x, 0.5, rng_key=K, global_shape=(8, 4))
    with pytest.raises(ValueError, match="2\\*\\*62"):
        KF.dropout(x, 0.5, rng_key=K, global_shape=(2**40, 2**40), region=(slice(0, 4), slice(0, 4)))
    with pytest.raises(TypeError, match="ordinal must be an int"):
        dropout_key(0, step=0, fqn="a", ordinal=0.5)
    with pytest.raises(ValueError, match="non-empty dot-separated"):
        dropout_key(0, step=0, fqn="a..b")


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_is_grad_times_keep_over_1_minus_p(dtype):
    x = data((5, 7, 9), dtype).requires_grad_()
    grad = data((5, 7, 9), dtype, seed=3)
    region = (slice(1, 6), slice(None), slice(0, 9))
    KF.dropout(x, 0.35, rng_key=K, global_shape=(8, 7, 9), region=region).backward(grad)
    assert_bits_equal(x.grad, expected(grad, 0.35, K, (8, 7, 9), region))


def test_gradcheck_and_double_backward():
    x = data((3, 5), torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: KF.dropout(t, 0.4, rng_key=K), (x,))
    assert torch.autograd.gradgradcheck(lambda t: KF.dropout(t, 0.4, rng_key=K) ** 2, (x,))


def _saved_elements(fn, x):
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x).sum().backward()
    return saved


def test_nothing_of_the_inputs_size_is_saved_for_backward():
    x = data((16, 64, 32)).requires_grad_()
    torch_saved = _saved_elements(lambda t: F.dropout(t, 0.1, True), x)
    assert max(torch_saved) == x.numel()  # torch keeps a mask as large as the input
    assert _saved_elements(lambda t: KF.dropout(t, 0.1, rng_key=K), x) == []
    region = ([3, 1, 2] + list(range(4, 17)), slice(None), slice(0, 32))
    indexed = _saved_elements(lambda t: KF.dropout(t, 0.1, rng_key=K, global_shape=(20, 64, 32), region=region), x)
    assert sum(indexed) == 16  # only the index vector of the non-range dimension


def test_torch_compile_fullgraph_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(t):
        return KF.dropout(t * 2, 0.25, rng_key=K, global_shape=(10, 6), region=(slice(3, 7), slice(None))) + 1

    counter = CompileCounterWithBackend("aot_eager")  # AOTAutograd: the fake kernel and the registered backward
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    x = data((4, 6)).requires_grad_()
    grad = data((4, 6), seed=5)
    out = compiled(x)
    out.backward(grad)
    compiled_grad, x.grad = x.grad, None
    fn(x).backward(grad)
    assert torch.equal(out, fn(x)) and torch.equal(compiled_grad, x.grad)
    compiled(x)
    assert counter.frame_count == 1
    with torch.no_grad():  # the fake kernel: shapes and dtypes under FakeTensorMode
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            fake = torch.empty(3, 4, dtype=torch.bfloat16)
            assert KF.dropout(fake, 0.5, rng_key=K).dtype == torch.bfloat16


def test_torch_compile_inductor_matches_eager():
    def fn(t):
        return KF.dropout(t, 0.5, rng_key=K)

    x = data((8, 5))
    assert torch.equal(torch.compile(fn, fullgraph=True)(x), fn(x))


def test_functional_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    x = data((50, 50)).requires_grad_()
    KF.dropout(x, 0.5, rng_key=K).sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_import_keyinit_builds_and_registers_nothing():
    code = (
        "import sys, torch, keyinit, keyinit.nn\n"
        "assert keyinit.nn is sys.modules['keyinit.nn'] and 'nn' in keyinit.__all__\n"
        "assert 'keyinit._kernels.dropout.cpu' not in sys.modules and 'keyinit.nn._ops.op' not in sys.modules\n"
        "assert 'triton' not in sys.modules\n"
        "try:\n    torch.ops.keyinit.dropout\nexcept (AttributeError, RuntimeError):\n    pass\n"
        "else:\n    raise AssertionError('keyinit::dropout registered at import')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_keyed_and_dropout_key_take_a_key_as_the_seed():
    # a Key is the root of the dropout keys, as init_model's seed: key(7) and 7 give the same masks
    assert dropout_key(keyinit.key(7), step=3, fqn="layers.1.attention") == K
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    x = data((6, 4))
    outs = []
    for seed in (7, keyinit.key(7), keyinit.key(8)):
        with keyinit.nn.keyed(model, seed, step=1):
            outs.append(model(x))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
