"""keyinit.nn_defaults: the rules give the distributions of torch 2.13's own reset_parameters."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

import keyinit
from keyinit import init
from keyinit.layouts import Target, target_for
from keyinit.nn_defaults import DEFAULT_RULES
from keyinit.regions import make_region
from keyinit.rules import RuleContext

SEED = 1234


def direct_tensors(module):
    pairs = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return {name: tensor for name, tensor in pairs if tensor is not None}


def context(module, prefix):
    tensors = direct_tensors(module)
    return RuleContext(prefix, {n: tuple(t.shape) for n, t in tensors.items()}, {n: t.dtype for n, t in tensors.items()})


def plan_module(module, prefix):
    return DEFAULT_RULES[type(module)](module, context(module, prefix))


def keyinit_tree(module, prefix="net"):
    """Apply DEFAULT_RULES to every module of the tree (exact type), writing through target_for.

    Returns the set of FQNs (relative to ``module``) that got an initializer.
    """
    planned = set()
    for path, sub in module.named_modules():
        if type(sub) not in DEFAULT_RULES:
            continue
        sub_prefix = f"{prefix}.{path}" if path else prefix
        for name, initializer in plan_module(sub, sub_prefix).items():
            tensor = getattr(sub, name)
            assert tensor is not None, f"rule planned the absent tensor {sub_prefix}.{name}"
            target = target_for(tensor, fqn=f"{sub_prefix}.{name}", module=sub, name=name)
            initializer(keyinit.key_for(SEED, target.fqn), target)
            planned.add(f"{path}.{name}" if path else name)
    return planned


def all_tensors(module):
    return dict([*module.named_parameters(), *module.named_buffers()])


def build_pair(factory):
    """(torch-initialized module, keyinit-initialized module, planned names); the global RNG is left as found."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        reference = factory()
        ours = factory()
    with torch.no_grad():
        for tensor in all_tensors(ours).values():
            tensor.fill_(77)  # garbage the rules must overwrite
    state = torch.get_rng_state()
    planned = keyinit_tree(ours)
    assert torch.equal(torch.get_rng_state(), state), "rules used the global RNG"
    return reference, ours, planned


def ks_statistic(a, b):
    a = a.detach().double().flatten().sort().values
    b = b.detach().double().flatten().sort().values
    grid = torch.cat([a, b])
    fa = torch.searchsorted(a, grid, right=True).double() / a.numel()
    fb = torch.searchsorted(b, grid, right=True).double() / b.numel()
    return (fa - fb).abs().max().item()


def ks_critical(n, m):
    return 1.95 * math.sqrt((n + m) / (n * m))  # two-sample KS at alpha = 0.001


def check_uniform(ours, theirs, bound):
    n = ours.numel()
    tolerance = bound * (1 + 1e-6)
    assert ours.abs().max() <= tolerance and theirs.abs().max() <= tolerance
    assert ours.abs().max() >= bound * (1 - 12 / n)  # P(miss) = (1 - 12/n)**n < 1e-5
    assert ks_statistic(ours, theirs) < ks_critical(n, theirs.numel())


def check_normal(ours, theirs, std):
    n = ours.numel()
    assert ks_statistic(ours, theirs) < ks_critical(n, theirs.numel())
    if n >= 10_000:
        assert ours.double().std().item() == pytest.approx(std, rel=0.03)


def U(bound):
    return ("uniform", bound)


def N(std):
    return ("normal", std)


EXACT = ("exact", None)

CONFIGS = {
    "linear": (lambda: nn.Linear(300, 200), {"weight": U(1 / math.sqrt(300)), "bias": U(1 / math.sqrt(300))}),
    "linear-nobias": (lambda: nn.Linear(300, 200, bias=False), {"weight": U(1 / math.sqrt(300))}),
    "linear-0-in": (lambda: nn.Linear(0, 3), {"weight": EXACT, "bias": EXACT}),
    "bilinear": (
        lambda: nn.Bilinear(20, 30, 100),
        {"weight": U(1 / math.sqrt(20)), "bias": U(1 / math.sqrt(20))},
    ),
    "conv1d": (lambda: nn.Conv1d(64, 128, 5), {"weight": U(1 / math.sqrt(320)), "bias": U(1 / math.sqrt(320))}),
    "conv2d-groups": (
        lambda: nn.Conv2d(48, 96, 3, groups=3),  # weight (96, 16, 3, 3): fan_in 144
        {"weight": U(1 / 12), "bias": U(1 / 12)},
    ),
    "conv3d-nobias": (lambda: nn.Conv3d(8, 16, (2, 3, 3), bias=False), {"weight": U(1 / 12)}),
    "convT1d": (  # weight (in=64, out=32, 5): torch's fan_in is size(1) * 5 = 160
        lambda: nn.ConvTranspose1d(64, 32, 5),
        {"weight": U(1 / math.sqrt(160)), "bias": U(1 / math.sqrt(160))},
    ),
    "convT2d-groups": (  # weight (48, 96 / 4, 3, 3): fan_in 216
        lambda: nn.ConvTranspose2d(48, 96, 3, groups=4),
        {"weight": U(1 / math.sqrt(216)), "bias": U(1 / math.sqrt(216))},
    ),
    "convT3d": (  # weight (8, 12, 2, 2, 2): fan_in 96
        lambda: nn.ConvTranspose3d(8, 12, 2),
        {"weight": U(1 / math.sqrt(96)), "bias": U(1 / math.sqrt(96))},
    ),
    "embedding-pad": (lambda: nn.Embedding(1000, 64, padding_idx=3), {"weight": N(1.0)}),
    "embedding-pad-neg": (lambda: nn.Embedding(100, 8, padding_idx=-1), {"weight": N(1.0)}),
    "embedding": (lambda: nn.Embedding(500, 32), {"weight": N(1.0)}),
    "embeddingbag-pad": (lambda: nn.EmbeddingBag(500, 16, padding_idx=0), {"weight": N(1.0)}),
    "layernorm": (lambda: nn.LayerNorm(32), {"weight": EXACT, "bias": EXACT}),
    "layernorm-nobias": (lambda: nn.LayerNorm((4, 8), bias=False), {"weight": EXACT}),
    "layernorm-noaffine": (lambda: nn.LayerNorm(8, elementwise_affine=False), {}),
    "rmsnorm": (lambda: nn.RMSNorm(16), {"weight": EXACT}),
    "rmsnorm-noaffine": (lambda: nn.RMSNorm([2, 8], elementwise_affine=False), {}),
    "groupnorm": (lambda: nn.GroupNorm(4, 16), {"weight": EXACT, "bias": EXACT}),
    "groupnorm-noaffine": (lambda: nn.GroupNorm(2, 8, affine=False), {}),
    "batchnorm1d": (
        lambda: nn.BatchNorm1d(10),
        {n: EXACT for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")},
    ),
    "batchnorm2d-noaffine": (
        lambda: nn.BatchNorm2d(10, affine=False),
        {n: EXACT for n in ("running_mean", "running_var", "num_batches_tracked")},
    ),
    "batchnorm3d-nostats": (lambda: nn.BatchNorm3d(10, track_running_stats=False), {"weight": EXACT, "bias": EXACT}),
    "syncbatchnorm": (
        lambda: nn.SyncBatchNorm(6),
        {n: EXACT for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")},
    ),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(6), {}),
    "instancenorm2d-affine-stats": (
        lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True),
        {n: EXACT for n in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")},
    ),
    "mha": (
        lambda: nn.MultiheadAttention(64, 4),
        {
            "in_proj_weight": U(math.sqrt(6 / (192 + 64))),
            "in_proj_bias": EXACT,
            "out_proj.weight": U(1 / 8),
            "out_proj.bias": EXACT,
        },
    ),
    "mha-kdim-vdim-biaskv": (
        lambda: nn.MultiheadAttention(64, 4, bias=False, add_bias_kv=True, kdim=32, vdim=48),
        {
            "q_proj_weight": U(math.sqrt(6 / 128)),
            "k_proj_weight": U(math.sqrt(6 / 96)),
            "v_proj_weight": U(math.sqrt(6 / 112)),
            "bias_k": N(math.sqrt(2 / 128)),  # xavier_normal of (1, 1, 64): fans 64, 64
            "bias_v": N(math.sqrt(2 / 128)),
            "out_proj.weight": U(1 / 8),
        },
    ),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_rule_matches_torch_reset_parameters(config):
    factory, expected = CONFIGS[config]
    reference, ours, planned = build_pair(factory)
    # Every tensor torch initializes gets an initializer, and only tensors that exist.
    assert planned == set(all_tensors(ours)) == set(expected)
    theirs_all, ours_all = all_tensors(reference), all_tensors(ours)
    for name, (kind, param) in expected.items():
        mine, theirs = ours_all[name].detach(), theirs_all[name].detach()
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        if kind == "exact":
            assert torch.equal(mine, theirs), name
        elif kind == "uniform":
            check_uniform(mine, theirs, param)
        else:
            check_normal(mine, theirs, param)


def test_deterministic_values_are_torchs():
    # Norm and BatchNorm defaults spelled out, beyond "equal to torch".
    _, bn, _ = build_pair(lambda: nn.BatchNorm2d(5))
    assert torch.equal(bn.weight.detach(), torch.ones(5)) and torch.equal(bn.bias.detach(), torch.zeros(5))
    assert torch.equal(bn.running_mean, torch.zeros(5)) and torch.equal(bn.running_var, torch.ones(5))
    assert bn.num_batches_tracked.dtype == torch.int64 and bn.num_batches_tracked.item() == 0
    _, mha, _ = build_pair(lambda: nn.MultiheadAttention(16, 2))
    assert torch.equal(mha.in_proj_bias.detach(), torch.zeros(48))
    assert torch.equal(mha.out_proj.bias.detach(), torch.zeros(16))


@pytest.mark.parametrize(("factory", "row"), [(lambda: nn.Embedding(1000, 64, padding_idx=3), 3),
                                              (lambda: nn.Embedding(100, 8, padding_idx=-1), 99),
                                              (lambda: nn.EmbeddingBag(500, 16, padding_idx=0), 0)])
def test_embedding_padding_row(factory, row):
    reference, ours, _ = build_pair(factory)
    weight = ours.weight.detach()
    assert torch.equal(weight[row], torch.zeros(weight.shape[1]))
    assert torch.equal(reference.weight.detach()[row], weight[row])
    others = torch.cat([weight[:row], weight[row + 1 :]])
    assert (others != 0).all()


def test_embedding_padding_row_is_region_aware():
    module = nn.Embedding(1000, 64, padding_idx=3)
    (initializer,) = plan_module(module, "emb").values()
    assert initializer == init.with_zero_rows(init.normal(), 3)
    key = keyinit.key_for(SEED, "emb.weight")

    def local(region):
        normalized = make_region((1000, 64), region)
        out = torch.full(normalized.region_shape, 77.0)
        initializer(key, Target("emb.weight", normalized, out))
        return out

    full = local(None)
    assert torch.equal(full[3], torch.zeros(64))
    for region in [(slice(0, 500), slice(None)), (slice(500, None), slice(None)), ([7, 3, 3], slice(0, 32)),
                   (slice(1, None, 2), slice(None)), (slice(3, 4), [])]:
        rows = make_region((1000, 64), region).indices
        assert torch.equal(local(region), full[rows[0]][:, rows[1]])
    assert (local((slice(500, None), slice(None))) != 0).all()


def test_fans_come_from_the_global_weight_shape():
    # A column shard of Linear(300, 400): the local weight is (400, 150), the global one (400, 300).
    module = nn.Linear(150, 400)  # the local module of the shard
    ctx = RuleContext("fc", {"weight": (400, 300), "bias": (400,)}, {"weight": torch.float32, "bias": torch.float32})
    plan = DEFAULT_RULES[nn.Linear](module, ctx)
    assert plan == {"weight": init.kaiming_uniform(a=math.sqrt(5)), "bias": init.uniform(-1 / math.sqrt(300), 1 / math.sqrt(300))}
    key = keyinit.key_for(SEED, "fc.weight")
    shard = make_region((400, 300), (slice(None), slice(150, 300)))
    local = torch.empty(shard.region_shape)
    plan["weight"](key, Target("fc.weight", shard, local))
    full = torch.empty(400, 300)
    plan["weight"](key, Target("fc.weight", make_region((400, 300), None), full))
    assert torch.equal(local, full[:, 150:])
    assert local.abs().max() <= 1 / math.sqrt(300) * (1 + 1e-6)


def test_conv_bias_fan_uses_global_weight_shape():
    module = nn.Conv2d(8, 16, 3)
    ctx = RuleContext("c", {"weight": (64, 32, 3, 3), "bias": (64,)}, {})
    assert DEFAULT_RULES[nn.Conv2d](module, ctx)["bias"] == init.uniform(-1 / math.sqrt(288), 1 / math.sqrt(288))


def test_mha_out_proj_rule_is_registered_for_the_child_type():
    mha = nn.MultiheadAttention(8, 2)
    assert type(mha.out_proj) is NonDynamicallyQuantizableLinear
    assert set(plan_module(mha, "attn")) == {"in_proj_weight", "in_proj_bias"}
    assert plan_module(mha.out_proj, "attn.out_proj") == {"weight": init.kaiming_uniform(a=math.sqrt(5)), "bias": init.zeros()}
    # A plain Linear keeps the uniform bias.
    assert isinstance(plan_module(nn.Linear(8, 8), "fc")["bias"], init.uniform)


def test_bilinear_with_no_inputs_is_an_error():
    module = nn.Bilinear(1, 2, 3)
    ctx = RuleContext("bl", {"weight": (3, 0, 2), "bias": (3,)}, {})
    with pytest.raises(ValueError, match=r"^bl\.weight: in1_features must be > 0, but got \(in1_features=0\)$"):
        DEFAULT_RULES[nn.Bilinear](module, ctx)


def test_rules_table():
    expected = {
        nn.Linear, NonDynamicallyQuantizableLinear, nn.Bilinear,
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
        nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
        nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.MultiheadAttention,
    }
    assert set(DEFAULT_RULES) == expected
    for rule in DEFAULT_RULES.values():
        assert inspect.isfunction(rule) and list(inspect.signature(rule).parameters) == ["module", "ctx"]


def test_rules_do_not_write():
    module = nn.Linear(4, 3)
    before = {n: t.detach().clone() for n, t in all_tensors(module).items()}
    plan_module(module, "fc")
    assert all(torch.equal(before[n], t) for n, t in all_tensors(module).items())
