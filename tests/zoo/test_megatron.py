"""megatron-core layers and models under real tensor and expert parallelism (gloo ranks, CPU).

Every multi-rank test builds the model with :func:`keyinit.deferred` (megatron initializes in
its constructors; built deferred, keyinit replays megatron's own ``init_method`` keyed),
materializes it with the collectives counted, gathers the full tensors afterwards with
megatron's own split rules (``partition_dim``, ``partition_stride``, the layer's TP rank; an
expert's global index from its expert-parallel rank) and compares them bit for bit with a
one-process TP=1/EP=1 build.

megatron-core is an optional test dependency: these tests skip without it.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import keyinit
from keyinit import init
from keyinit.layouts import MegatronLayout, register_layout, unregister_layout
from tests._support.dist import requires_gloo, run_distributed

with warnings.catch_warnings():  # megatron warns at import that Transformer Engine and Apex are missing
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")

pytestmark = requires_gloo

SEED = 11
EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _quiet() -> None:
    warnings.filterwarnings("ignore")


def _gpt(vocab: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
        use_cpu_initialization=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2, init_method_std=0.02,
    )
    return GPTModel(config, get_gpt_layer_local_spec(num_experts=4), vocab_size=vocab, max_sequence_length=8,
                    position_embedding_type="rope")


def _layers(tp_group):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.utils import init_method_normal

    config = ModelParallelConfig(use_cpu_initialization=True)
    model = torch.nn.Module()
    model.emb = VocabParallelEmbedding(16, 8, config=config, init_method=init_method_normal(0.02),
                                       tp_group=tp_group)  # vocab 13 padded to 16
    model.col = ColumnParallelLinear(8, 16, config=config, init_method=init_method_normal(0.02), bias=True,
                                     stride=2, gather_output=False, tp_group=tp_group)
    model.row = RowParallelLinear(16, 8, config=config, init_method=init_method_normal(0.05), bias=True,
                                  input_is_parallel=True, skip_bias_add=False, tp_group=tp_group)
    return model


def _materialize_and_report(model, tp_group=None) -> dict:
    """Materialize under counted collectives; return what the parent needs to reassemble full tensors."""
    from megatron.core import parallel_state

    from tests.init.test_model_dist import count_collectives

    with count_collectives() as counts:
        report = keyinit.materialize(model, SEED, device="cpu")
    experts = {}
    for name, module in model.named_modules():
        if "local_experts" in module._modules:
            experts[name] = (module.ep_group.rank(), module.num_local_experts)
    tensors = {}
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        group = owner.tp_group if "tp_group" in vars(owner) else None
        rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
        if group is None and parallel_state.is_initialized() and getattr(p, "tensor_model_parallel", False):
            raise AssertionError(f"{name}: megatron layer without tp_group")
        tensors[name] = (p.detach().clone(), bool(getattr(p, "tensor_model_parallel", False)),
                         int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1)), rank, size)
    return {"counts": dict(counts), "tensors": tensors, "experts": experts,
            "keys": sorted(r.key_fqn for r in report.records)}


def _global_name(name: str, experts: dict) -> str:
    match = EXPERT.search(name)
    if match is None:
        return name
    prefix = name[:match.start()]
    ep_rank, count = experts[prefix]
    return f"{prefix}.local_experts.{ep_rank * count + int(match.group(1))}.{name[match.end():]}"


def _assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards, as megatron splits them (checks that replicas agree)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    meta: dict[str, tuple] = {}
    for result in results:
        for name, (tensor, marked, dim, stride, rank, size) in result["tensors"].items():
            name = _global_name(name, result["experts"])
            if not marked:
                rank, size = 0, 1
            if rank in parts.setdefault(name, {}):
                assert torch.equal(parts[name][rank], tensor), f"{name}: replicas differ"
            parts[name][rank] = tensor
            meta[name] = (dim, stride, size)
    full = {}
    for name, by_rank in parts.items():
        dim, stride, size = meta[name]
        assert sorted(by_rank) == list(range(size)), name
        chunks = [by_rank[r].chunk(stride, dim) for r in range(size)]
        full[name] = torch.cat([chunks[r][k] for k in range(stride) for r in range(size)], dim)
    return full


def _assert_bit_identical(reference: dict, results: list[dict]) -> None:
    full = _assemble(results)
    assert sorted(full) == sorted(reference)
    for name, expected in reference.items():
        assert torch.equal(full[name], expected), name
    for result in results:
        assert result["counts"] == {"c10d": 0, "comm_debug": 0}


def _gpt_rank(tp: int, ep: int, etp: int) -> dict:
    _quiet()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=etp)
    try:
        return _materialize_and_report(keyinit.deferred(_gpt, 24))
    finally:
        parallel_state.destroy_model_parallel()


def _layers_rank(explicit_group: bool) -> dict:
    _quiet()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)  # parallel_state says TP=1
    try:
        group = dist.new_group(list(range(dist.get_world_size()))) if explicit_group else None
        return _materialize_and_report(keyinit.deferred(_layers, group))
    finally:
        parallel_state.destroy_model_parallel()


def _reference(fn, *args) -> dict[str, torch.Tensor]:
    result = run_distributed(fn, 1, args=args)[0]
    return {name: values[0] for name, values in result["tensors"].items()}


def test_gpt_moe_tp2_ep2_with_expert_tp1_is_bit_identical_to_one_process():
    """Dense layers split over TP=2 (fused QKV, gated MLP fc1 with stride 2); experts whole (expert TP=1)
    and spread over EP=2, named by local index on each rank: every tensor matches the TP=1/EP=1 build."""
    reference = _reference(_gpt_rank, 1, 1, 1)
    for fqn, std in (("decoder.layers.0.self_attention.linear_qkv.weight", 0.02),
                     ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", 0.02),
                     ("embedding.word_embeddings.weight", 0.02)):
        # megatron's init_method (init_method_normal(0.02)) drew the master weight: keyed like the rule
        owner = torch.nn.Module()
        owner.weight = torch.nn.Parameter(torch.empty(reference[fqn].shape))
        keyinit.init_model(owner, SEED, rules={fqn: init.normal(std=std)}, fqn_prefix=fqn.rpartition(".")[0])
        assert torch.equal(reference[fqn], owner.weight), fqn
    results = run_distributed(_gpt_rank, 2, args=(2, 2, 1))
    keys = results[1]["keys"]
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" in keys  # keyed by global index
    assert not any(".local_experts.0." in key for key in keys)
    _assert_bit_identical(reference, results)


def test_gpt_moe_tp2_with_expert_tp2_is_bit_identical_to_one_process():
    reference = _reference(_gpt_rank, 1, 1, 1)
    _assert_bit_identical(reference, run_distributed(_gpt_rank, 2, args=(2, 1, 2)))


def test_layers_with_an_explicit_tp_group_are_split_by_it_not_by_parallel_state():
    """parallel_state says TP=1, the layers were built with a 4-rank tp_group: keyinit reads the layer's group."""
    reference = _reference(_layers_rank, False)
    results = run_distributed(_layers_rank, 4, args=(True,))
    assert results[3]["tensors"]["col.weight"][0].shape == (4, 8)
    _assert_bit_identical(reference, results)


def _contradiction_rank() -> str:
    _quiet()
    group = dist.new_group([0, 1])
    model = keyinit.deferred(_layers, group)
    layout = register_layout(MegatronLayout(0, 4))
    try:
        keyinit.materialize(model, SEED, device="cpu")
    except keyinit.PlanError as exc:
        return str(exc)
    finally:
        unregister_layout(layout)
    return "no error"


def test_a_registered_layout_contradicting_the_layers_group_is_an_error_naming_the_tensor():
    messages = run_distributed(_contradiction_rank, 2)
    assert all(re.search(r"emb\.weight: the registered MegatronLayout\(tp_rank=0, tp_size=4\) contradicts its "
                         r"layer's own tp_group \(rank \d of 2\)", m) for m in messages), messages
