"""keyinit.init: region == slice of the full tensor, torch-exact constants and statistics, errors."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keyinit
from keyinit import init
from keyinit.layouts import Target
from keyinit.regions import make_region

KEY = keyinit.key_for(20240501, "layer.weight")
FQN = "layer.weight"


def run(initializer, shape, region=None, *, dtype=torch.float32, out=None, fqn=FQN, key=KEY):
    """Apply ``initializer`` to ``region`` of a tensor of global ``shape``; return the local tensor."""
    normalized = make_region(tuple(shape), region)
    if out is None:
        out = torch.full(normalized.region_shape, 7, dtype=dtype)  # garbage that must be overwritten
    initializer(key, Target(fqn, normalized, out))
    return out


def take(full, region):
    """``full[region]`` with numpy.ix_ semantics."""
    normalized = make_region(tuple(full.shape), region)
    block = full
    for dim, index in enumerate(normalized.indices):
        block = block.index_select(dim, index)
    return block


def regions_for(shape):
    """Several regions of ``shape``: halves, strided slices, shuffled/negative index lists, empty."""
    nd = len(shape)
    whole = [slice(None)] * nd
    found = [None]
    for dim, size in enumerate(shape):
        half = list(whole)
        half[dim] = slice(size // 2, None)
        found.append(tuple(half))
    strided = [slice(1, None, 2) if s > 1 else slice(None) for s in shape]
    found.append(tuple(strided))
    picked = [[s - 1, 0, -1, s // 2] for s in shape]  # shuffled, negative, duplicated
    found.append(tuple(picked))
    tensor_rows = list(whole)
    tensor_rows[0] = torch.tensor([shape[0] - 1, 0])
    found.append(tuple(tensor_rows))
    empty_first = list(whole)
    empty_first[0] = slice(0, 0)
    found.append(tuple(empty_first))
    empty_last = list(whole)
    empty_last[-1] = []
    found.append(tuple(empty_last))
    return found


SQRT5 = math.sqrt(5)

CASES = [
    (init.uniform(-2, 3), (7, 5)),
    (init.uniform(0.25, 0.25), (4, 3)),
    (init.normal(1.0, 2.0), (7, 5)),
    (init.truncated_normal(0.5, 1.0, -1.0, 2.0), (7, 5)),
    (init.constant(2.5), (7, 5)),
    (init.zeros(), (3, 4, 5)),
    (init.ones(), (6,)),
    (init.eye(), (7, 5)),
    (init.eye(), (3, 8)),
    (init.dirac(), (4, 4, 3)),
    (init.dirac(2), (6, 4, 3, 3)),
    (init.dirac(3), (6, 1, 3, 2, 3)),
    (init.xavier_uniform(2.0), (7, 5, 3)),
    (init.xavier_normal(), (7, 5)),
    (init.kaiming_uniform(a=SQRT5), (7, 5, 2)),
    (init.kaiming_normal(mode="fan_out", nonlinearity="relu"), (7, 5)),
    (init.variance_scaling(2.0, "fan_avg", "truncated_normal"), (7, 5, 3)),
    (init.variance_scaling(0.5, "fan_out", "normal", in_axis=-2, out_axis=-1), (3, 7, 5)),
    (init.variance_scaling(1.0, "fan_in", "uniform", in_axis=(1, 2), out_axis=0, batch_axis=3), (7, 2, 3, 4)),
    (init.lecun_normal(), (7, 5)),
    (init.lecun_uniform(), (7, 5)),
    (init.he_normal(), (7, 5)),
    (init.he_uniform(), (7, 5)),
    (init.glorot_normal(), (7, 5)),
    (init.glorot_uniform(), (7, 5)),
    (init.orthogonal(2.0), (7, 5)),
    (init.orthogonal(), (3, 4, 2)),
    (init.with_zero_rows(init.normal(), (1, -1)), (7, 5)),
    (init.with_zero_rows(init.kaiming_uniform(), 2), (7, 5)),
]
CASE_IDS = [f"{type(i).__name__}-{'x'.join(map(str, s))}" for i, s in CASES]


@pytest.mark.parametrize(("initializer", "shape"), CASES, ids=CASE_IDS)
def test_region_is_slice_of_full(initializer, shape):
    full = run(initializer, shape)
    assert full.shape == shape
    for region in regions_for(shape):
        local = run(initializer, shape, region)
        assert torch.equal(local, take(full, region)), region


@pytest.mark.parametrize(("initializer", "shape"), CASES, ids=CASE_IDS)
def test_non_contiguous_out(initializer, shape):
    full = run(initializer, shape)
    region = regions_for(shape)[-3]  # picked indices, every dim
    local_shape = make_region(shape, region).region_shape
    out = torch.full(tuple(reversed(local_shape)), 7.0).permute(*reversed(range(len(shape))))
    assert not out.is_contiguous() or len(shape) == 1
    run(initializer, shape, region, out=out)
    assert torch.equal(out, take(full, region))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_regions_of_kaiming_and_dirac(data):
    shape = (6, 4, 3)
    region = tuple(
        data.draw(st.lists(st.integers(-size, size - 1), max_size=5), label=f"dim{d}") for d, size in enumerate(shape)
    )
    for initializer in (init.kaiming_uniform(a=SQRT5), init.dirac(2), init.orthogonal()):
        assert torch.equal(run(initializer, shape, region), take(run(initializer, shape), region))


def test_same_values_for_every_key_and_fqn_only():
    a = run(init.normal(), (4, 4))
    assert torch.equal(a, run(init.normal(), (4, 4), fqn="other.name"))  # the fqn only labels errors
    assert not torch.equal(a, run(init.normal(), (4, 4), key=keyinit.key_for(1, "layer.weight")))


# --------------------------------------------------------------------------- fans


def test_fans_come_from_the_global_shape():
    shape = (64, 32)
    full = run(init.kaiming_uniform(a=SQRT5), shape)
    rows = run(init.kaiming_uniform(a=SQRT5), shape, (slice(0, 8), slice(None)))
    cols = run(init.kaiming_uniform(a=SQRT5), shape, (slice(None), slice(16, 32)))
    assert torch.equal(rows, full[0:8]) and torch.equal(cols, full[:, 16:32])
    # A plain local tensor of the column shard's shape would get a wider bound: 1/sqrt(16).
    assert cols.abs().max() <= 1 / math.sqrt(32) * (1 + 1e-6)
    assert run(init.kaiming_uniform(a=SQRT5), (64, 16)).abs().max() > 1 / math.sqrt(32)


@pytest.mark.parametrize(
    "shape", [(5, 3), (4, 3, 2), (2, 3, 4, 5), (3, 2, 1, 2, 2), (1, 1), (0, 4)]
)
def test_fans_match_torch(shape):
    expected = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    assert init.calculate_fan_in_and_fan_out(shape) == expected


def test_fans_with_axes_match_jax_convention():
    # JAX: in_axis=-2, out_axis=-1, receptive field = the rest.
    assert init.calculate_fan_in_and_fan_out((3, 3, 16, 32), in_axis=-2, out_axis=-1) == (144, 288)
    assert init.calculate_fan_in_and_fan_out((8, 3, 16, 32), -2, -1, batch_axis=0) == (48, 96)
    assert init.calculate_fan_in_and_fan_out((8, 16, 32), -2, -1, batch_axis=0) == (16, 32)
    assert init.calculate_fan_in_and_fan_out((2, 3, 4, 5), in_axis=(1, 2), out_axis=0) == (60, 10)


@pytest.mark.parametrize("nonlinearity", ["linear", "conv1d", "conv_transpose3d", "sigmoid", "tanh", "relu", "selu"])
def test_calculate_gain_matches_torch(nonlinearity):
    assert init.calculate_gain(nonlinearity) == torch.nn.init.calculate_gain(nonlinearity)


@pytest.mark.parametrize("param", [None, 0, 0.2, SQRT5, 3])
def test_leaky_relu_gain_matches_torch(param):
    assert init.calculate_gain("leaky_relu", param) == torch.nn.init.calculate_gain("leaky_relu", param)


# --------------------------------------------------------------------------- exact against torch


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (1, 6), (0, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_eye_equals_torch(shape, dtype):
    expected = torch.nn.init.eye_(torch.empty(shape, dtype=dtype))
    assert torch.equal(run(init.eye(), shape, dtype=dtype), expected)


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((4, 4, 3), 1), ((6, 4, 5), 2), ((3, 5, 3), 1), ((6, 2, 3, 3), 3), ((8, 4, 2, 4), 2), ((4, 4, 3, 3, 3), 2),
     ((6, 6, 1, 2, 3), 1), ((4, 2, 3, 3), 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bool])
def test_dirac_equals_torch(shape, groups, dtype):
    expected = torch.nn.init.dirac_(torch.empty(shape, dtype=dtype), groups)
    assert torch.equal(run(init.dirac(groups), shape, dtype=dtype), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                                   torch.int64, torch.bool])
def test_zeros_ones_any_dtype(dtype):
    assert torch.equal(run(init.zeros(), (3, 2), dtype=dtype), torch.zeros(3, 2, dtype=dtype))
    assert torch.equal(run(init.ones(), (3, 2), dtype=dtype), torch.ones(3, 2, dtype=dtype))


def test_constant_values():
    assert torch.equal(run(init.constant(-3), (2,), dtype=torch.int8), torch.full((2,), -3, dtype=torch.int8))
    assert torch.equal(run(init.constant(4.0), (2,), dtype=torch.int64), torch.full((2,), 4))
    assert torch.equal(run(init.constant(True), (2,), dtype=torch.bool), torch.ones(2, dtype=torch.bool))
    assert torch.equal(run(init.constant(0.1), (2,), dtype=torch.bfloat16), torch.full((2,), 0.1, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "initializer", [init.uniform(-1, 1), init.normal(0.0, 0.5), init.kaiming_uniform(), init.xavier_normal()],
    ids=repr,
)
def test_low_precision_is_the_float32_draw_rounded(initializer, dtype):
    assert torch.equal(run(initializer, (9, 7), dtype=dtype), run(initializer, (9, 7)).to(dtype))


# --------------------------------------------------------------------------- orthogonal


@pytest.mark.parametrize("shape", [(32, 32), (40, 12), (12, 40), (6, 4, 5), (1, 9)])
def test_orthogonal_is_orthogonal(shape):
    gain = 1.5
    q = run(init.orthogonal(gain), shape, dtype=torch.float64).reshape(shape[0], -1) / gain
    small = min(q.shape)
    gram = q.T @ q if q.shape[0] >= q.shape[1] else q @ q.T
    assert torch.allclose(gram, torch.eye(small, dtype=torch.float64), atol=1e-6)


def test_orthogonal_regions_and_determinism():
    shape = (24, 10)
    full = run(init.orthogonal(), shape)
    assert torch.equal(full, run(init.orthogonal(), shape))
    for region in regions_for(shape):
        assert torch.equal(run(init.orthogonal(), shape, region), take(full, region))
    assert init.orthogonal.element_local is False and init.orthogonal().element_local is False
    assert init.normal().element_local is True
    assert init.with_zero_rows(init.orthogonal(), 0).element_local is False


def test_orthogonal_uses_the_keyed_normal_and_torch_sign_fix():
    shape = (6, 4)
    draw = keyinit.random.normal(KEY, shape).double()
    q, r = torch.linalg.qr(draw)
    expected = (q * torch.diagonal(r).sign()).float()
    assert torch.allclose(run(init.orthogonal(), shape), expected, atol=1e-6)


# --------------------------------------------------------------------------- statistics


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def assert_uniform(values, bound):
    v = values.double()
    assert v.abs().max() <= f32(bound) * (1 + 1e-6)
    assert v.max() > 0.999 * bound and v.min() < -0.999 * bound
    assert abs(v.mean()) < 0.005 * bound
    assert v.var().item() == pytest.approx(bound**2 / 3, rel=0.01)


def test_kaiming_uniform_bound():
    shape = (256, 250, 4)  # 2**18 samples, fan_in 1000
    assert_uniform(run(init.kaiming_uniform(a=SQRT5), shape), 1 / math.sqrt(1000))
    relu = run(init.kaiming_uniform(mode="fan_out", nonlinearity="relu"), (100, 2000))
    assert_uniform(relu, math.sqrt(2) * math.sqrt(3 / 100))


def test_xavier_and_kaiming_normal_std():
    shape = (128, 400, 5)  # fan_in 2000, fan_out 640
    xavier = run(init.xavier_normal(gain=0.5), shape).double()
    assert xavier.std().item() == pytest.approx(0.5 * math.sqrt(2 / 2640), rel=0.01)
    assert abs(xavier.mean()) < 0.005 * xavier.std()
    kaiming = run(init.kaiming_normal(a=0.2, mode="fan_out"), (2000, 128)).double()
    assert kaiming.std().item() == pytest.approx(math.sqrt(2 / 1.04) / math.sqrt(2000), rel=0.01)


def test_xavier_uniform_bound():
    assert_uniform(run(init.xavier_uniform(gain=2.0), (300, 700)), 2.0 * math.sqrt(6 / 1000))


@pytest.mark.parametrize(
    ("mode", "variance"), [("fan_in", 2.0 / 800), ("fan_out", 2.0 / 1250), ("fan_avg", 2.0 / 1025)]
)
def test_variance_scaling_truncated_normal(mode, variance):
    # 1e6 samples: the variance is scale / n to 1%, and every value lies within 2 corrected stddevs.
    values = run(init.variance_scaling(2.0, mode, "truncated_normal"), (1250, 800)).double()
    stddev = math.sqrt(variance) / 0.87962566103423978
    assert values.abs().max() <= 2 * stddev * (1 + 1e-6)
    assert values.abs().max() > 1.999 * stddev
    assert values.var().item() == pytest.approx(variance, rel=0.01)


def test_variance_scaling_normal_and_uniform():
    normal = run(init.variance_scaling(3.0, "fan_in", "normal", in_axis=-2, out_axis=-1), (1000, 256)).double()
    assert normal.var().item() == pytest.approx(3.0 / 1000, rel=0.01)
    assert_uniform(run(init.he_uniform(), (128, 2000)), math.sqrt(6 / 2000))


def test_trunc_normal_absolute_bounds():
    mean, std, a, b = 1.0, 2.0, -1.0, 2.0
    values = run(init.truncated_normal(mean, std, a, b), (512, 512)).double()
    assert values.min() >= a and values.max() <= b
    alpha, beta = (a - mean) / std, (b - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = cdf(beta) - cdf(alpha)
    expected_mean = mean + std * (pdf(alpha) - pdf(beta)) / z
    expected_var = std**2 * (1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z - ((pdf(alpha) - pdf(beta)) / z) ** 2)
    assert values.mean().item() == pytest.approx(expected_mean, abs=0.002)
    assert values.var().item() == pytest.approx(expected_var, rel=0.01)


def test_uniform_and_normal_moments():
    u = run(init.uniform(-1.0, 3.0), (1 << 18,)).double()
    assert u.min() >= -1 and u.max() <= 3
    assert u.mean().item() == pytest.approx(1.0, abs=0.01) and u.var().item() == pytest.approx(16 / 12, rel=0.01)
    n = run(init.normal(-2.0, 0.5), (1 << 18,)).double()
    assert n.mean().item() == pytest.approx(-2.0, abs=0.005) and n.std().item() == pytest.approx(0.5, rel=0.01)


def test_degenerate_uniform_and_empty_global_tensors():
    assert torch.equal(run(init.uniform(0, 0), (4,)), torch.zeros(4))
    for initializer in (init.kaiming_uniform(), init.kaiming_normal(), init.xavier_uniform(), init.xavier_normal(),
                        init.he_normal(), init.orthogonal()):
        assert run(initializer, (0, 5)).shape == (0, 5)  # nothing to write, no division by a zero fan


# --------------------------------------------------------------------------- values, immutability, RNG


def test_initializers_are_frozen_hashable_values():
    a, b = init.kaiming_uniform(a=SQRT5), init.kaiming_uniform(a=SQRT5)
    assert a == b and hash(a) == hash(b) and len({a, b, init.kaiming_uniform()}) == 2
    assert repr(init.normal(0.0, 0.02)) == "normal(mean=0.0, std=0.02)"
    assert repr(init.zeros()) == "constant(value=0)"
    assert init.glorot_uniform() == init.variance_scaling(1.0, "fan_avg", "uniform", in_axis=1, out_axis=0)
    assert init.variance_scaling(1.0, "fan_in", "uniform", in_axis=[1, 2]).in_axis == (1, 2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        a.mode = "fan_out"
    assert hash(init.with_zero_rows(init.normal(), [1, 2])) == hash(init.with_zero_rows(init.normal(), (1, 2)))



def test_no_global_rng_use():
    state = torch.get_rng_state()
    for initializer, shape in CASES:
        run(initializer, shape)
        run(initializer, shape, regions_for(shape)[2])
    assert torch.equal(torch.get_rng_state(), state)


def test_writes_into_a_parameter_that_requires_grad():
    param = torch.nn.Parameter(torch.empty(4, 3))
    for initializer in (init.kaiming_uniform(), init.zeros(), init.eye(), init.orthogonal(),
                        init.with_zero_rows(init.normal(), 0)):
        run(initializer, (4, 3), out=param)
        assert param.requires_grad and param.grad_fn is None


# --------------------------------------------------------------------------- errors

FAN_MESSAGE = "fan in and fan out can not be computed for a tensor with fewer than 2 dimensions, got shape (5,)"


@pytest.mark.parametrize(
    "initializer",
    [init.kaiming_uniform(), init.kaiming_normal(), init.xavier_uniform(), init.xavier_normal(), init.lecun_normal()],
    ids=repr,
)
def test_fans_of_a_1d_tensor(initializer):
    with pytest.raises(ValueError) as info:
        run(initializer, (5,), fqn="block.0.bias")
    assert str(info.value) == f"block.0.bias: {FAN_MESSAGE}"


def test_fans_of_a_1d_shape():
    with pytest.raises(ValueError) as info:
        init.calculate_fan_in_and_fan_out((5,))
    assert str(info.value) == FAN_MESSAGE
    with pytest.raises(ValueError, match="^in_axis 2 is out of range for a 2-D tensor$"):
        init.calculate_fan_in_and_fan_out((5, 4), in_axis=2)
    with pytest.raises(ValueError, match="must name distinct dimensions"):
        init.calculate_fan_in_and_fan_out((5, 4), in_axis=0, out_axis=0)


def test_bad_names():
    message = "Mode fan_avg not supported, please use one of ['fan_in', 'fan_out']"
    for cls in (init.kaiming_uniform, init.kaiming_normal):
        with pytest.raises(ValueError) as info:
            cls(mode="fan_avg")
        assert str(info.value) == message
        with pytest.raises(ValueError) as info:
            cls(nonlinearity="gelu")
        assert str(info.value) == "Unsupported nonlinearity gelu"
    with pytest.raises(ValueError) as info:
        init.calculate_gain("leaky_relu", "0.1")
    assert str(info.value) == "negative_slope 0.1 not a valid number"
    with pytest.raises(ValueError) as info:
        init.variance_scaling(1.0, "fan_sum", "normal")
    assert str(info.value) == "invalid mode for variance scaling initializer: fan_sum"
    with pytest.raises(ValueError) as info:
        init.variance_scaling(1.0, "fan_in", "cauchy")
    assert str(info.value) == "invalid distribution for variance scaling initializer: cauchy"
    with pytest.raises(ValueError) as info:
        init.variance_scaling(0.0, "fan_in", "normal")
    assert str(info.value) == "variance_scaling: scale must be positive, got 0.0"


def test_bad_parameters():
    with pytest.raises(ValueError, match=r"^uniform: expected low <= high, got low=1, high=0$"):
        init.uniform(1, 0)
    with pytest.raises(ValueError, match=r"^normal: std must be >= 0, got -1$"):
        init.normal(0, -1)
    with pytest.raises(ValueError, match=r"^truncated_normal: expected a < b, got a=2, b=2$"):
        init.truncated_normal(a=2, b=2)
    with pytest.raises(TypeError, match=r"^xavier_uniform: gain must be a real number, got str$"):
        init.xavier_uniform("1")
    with pytest.raises(ValueError, match=r"^orthogonal: gain must be >= 0, got -1$"):
        init.orthogonal(-1)
    with pytest.raises(ValueError, match=r"^dirac: groups must be a positive int, got 0$"):
        init.dirac(0)
    with pytest.raises(TypeError, match=r"^constant: value must be a real number or a bool, got str$"):
        init.constant("0")
    with pytest.raises(TypeError, match=r"^with_zero_rows: base must be an Initializer, got function$"):
        init.with_zero_rows(init.zeros, 0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64])
@pytest.mark.parametrize(
    "initializer",
    [init.uniform(), init.normal(), init.truncated_normal(), init.kaiming_uniform(), init.xavier_normal(),
     init.he_normal(), init.orthogonal(), init.with_zero_rows(init.normal(), 0)],
    ids=repr,
)
def test_random_initializer_on_non_float_tensor(initializer, dtype):
    name = type(initializer).__name__
    if name == "variance_scaling":
        name = "variance_scaling"
    if name == "with_zero_rows":
        name = "normal"
    with pytest.raises(TypeError) as info:
        run(initializer, (3, 4), dtype=dtype, fqn="emb.weight")
    assert str(info.value) == (
        f"emb.weight: {name} draws floating-point values and cannot fill a {dtype} tensor "
        f"(supported: float32, float64, bfloat16, float16)"
    )


@pytest.mark.parametrize(
    ("value", "dtype"), [(0.5, torch.int64), (300, torch.uint8), (-1, torch.uint8), (2, torch.bool), (math.inf, torch.int32)]
)
def test_constant_that_an_integer_dtype_cannot_hold(value, dtype):
    with pytest.raises(ValueError) as info:
        run(init.constant(value), (2,), dtype=dtype, fqn="counter")
    assert str(info.value) == f"counter: constant value {value!r} cannot be stored exactly in a {dtype} tensor"


def test_shape_errors_name_the_fqn():
    with pytest.raises(ValueError, match=r"^lin\.weight: eye needs a 2-D tensor, got global shape \(2, 2, 2\)$"):
        run(init.eye(), (2, 2, 2), fqn="lin.weight")
    with pytest.raises(ValueError, match=r"^c\.weight: dirac needs a 3-, 4- or 5-D tensor, got global shape \(2, 2\)$"):
        run(init.dirac(), (2, 2), fqn="c.weight")
    with pytest.raises(
        ValueError, match=r"^c\.weight: dim 0 of global shape \(5, 2, 3\) must be divisible by groups=2$"
    ):
        run(init.dirac(2), (5, 2, 3), fqn="c.weight")
    with pytest.raises(
        ValueError, match=r"^b: orthogonal needs a tensor with 2 or more dimensions, got global shape \(4,\)$"
    ):
        run(init.orthogonal(), (4,), fqn="b")
    with pytest.raises(IndexError, match=r"^e\.weight: row 9 is out of range for global shape \(9, 2\)$"):
        run(init.with_zero_rows(init.normal(), 9), (9, 2), fqn="e.weight")


def test_sampler_errors_name_the_fqn():
    # No bfloat16 value lies in [1.001, 1.002]: the sampler's error gets the FQN in front.
    with pytest.raises(ValueError, match=r"^w: truncated_normal: no torch\.bfloat16 value lies in"):
        run(init.truncated_normal(1.0, 1.0, 1.001, 1.002), (3,), dtype=torch.bfloat16, fqn="w")


def test_trunc_normal_is_a_deprecated_name_of_truncated_normal():
    # keyinit names each distribution once; torch's name still works, warns and gives the same initializer
    with pytest.warns(DeprecationWarning, match="use keyinit.init.truncated_normal"):
        old = init.trunc_normal(0.0, 0.02, -0.04, 0.04)
    assert old == init.truncated_normal(0.0, 0.02, -0.04, 0.04)
    assert "trunc_normal" not in init.__all__
