"""Every script in examples/ runs, at a small size, and shows what it claims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import keyinit  # noqa: E402
from examples import existing_init_code, llama_fsdp2_tp, manual_parallel, models, pipeline  # noqa: E402


def test_models_are_meta_friendly_and_run_forward():
    with torch.device("meta"):
        meta = models.llama("llama3-8b")
    assert sum(p.numel() for p in meta.parameters()) == 8_030_261_248  # Llama-3-8B's parameter count
    for size in ("tiny",):
        with torch.device("meta"):
            model = models.llama(size)
        keyinit.materialize(model, 0, device="cpu", rules=models.llama_rules(model.args))
        logits = model(torch.randint(0, model.args.vocab_size, (2, 5)))
        assert logits.shape == (2, 5, model.args.vocab_size) and torch.isfinite(logits).all()
    with torch.device("meta"):
        net = models.convnet("tiny")
    keyinit.materialize(net, 0, device="cpu")
    assert net(torch.randn(2, 3, 8, 8)).shape == (2, 10)


def test_pipeline_stage_keeps_fqns():
    full = models.llama("tiny", n_layers=5, tie_embeddings=True)
    names = dict(full.named_parameters(remove_duplicate=False))
    stages = [models.pipeline_stage(models.llama("tiny", n_layers=5, tie_embeddings=True), s, 3) for s in range(3)]
    owned = [set(dict(s.named_parameters(remove_duplicate=False))) for s in stages]
    assert set().union(*owned) == set(names)
    assert not owned[0] & owned[1] and not owned[1] & owned[2]
    assert [len(s.layers) for s in stages] == [2, 2, 1]
    assert "output.weight" in owned[2] and "tok_embeddings.weight" in owned[0]


@pytest.mark.slow
def test_llama_fsdp2_tp_spawned_2x2():
    results = llama_fsdp2_tp.main(["--nproc", "4", "--tp", "2"])
    assert [r["identical"] for r in results] == [r["total"] for r in results] == [21] * 4
    losses = {round(r["loss"], 6) for r in results}
    assert len(losses) == 2  # one loss per dp rank (different data), shared inside each tp group
    assert all(0 < loss < 10 for loss in losses)


@pytest.mark.slow
def test_pipeline_two_stages_tied_embeddings():
    results = pipeline.main(["--nproc", "2"])
    assert all(r["identical"] == r["total"] for r in results)
    assert "tok_embeddings.weight" in results[0]["fqns"] and "output.weight" in results[1]["fqns"]
    assert results[1]["loss"] is not None and 0 < results[1]["loss"] < 10


def test_manual_parallel_every_sharding():
    assert manual_parallel.main(["--world-size", "3", "--vocab", "101", "--dim", "8"]) == {
        kind: True for kind in manual_parallel.KINDS
    }


def test_manual_parallel_shard_is_a_slice_of_the_full_table():
    full = manual_parallel.Model(50, 6)
    keyinit.init_model(full, 9, rules={"table.weight": manual_parallel.INIT})
    shard = manual_parallel.init_shard("round-robin rows", 1, 4, 50, 6, 9)
    assert torch.equal(shard.table.local, full.table.weight[1::4])


def test_existing_init_code():
    results = existing_init_code.main()
    assert results == {"titan seed-independent": True, "titan_model": True, "hf_model": True,
                       "hf_model_with_padding_rule": True}


def test_existing_init_code_matches_torch_distributions():
    """Keyed init code draws the distributions the code asks for (not torch's bits)."""
    model, kwargs = existing_init_code.titan_model()
    keyinit.init_model(model, 0, **kwargs)
    wo = model.layers["1"].attention.wo.weight.detach()
    std = 0.02 / (2 * 2) ** 0.5
    assert abs(float(wo.std()) / std - 1) < 0.1  # trunc_normal_'s bounds are absolute (+-2): ~N(0, std**2) here
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    hf, kwargs = existing_init_code.hf_model_with_padding_rule()
    keyinit.init_model(hf, 0, **kwargs)
    assert torch.equal(hf.embed_tokens.weight[3], torch.zeros(24))
    assert torch.equal(hf.layers[0].q_proj.bias, torch.zeros(24))


@pytest.mark.slow
def test_deferred_vision_fsdp2_two_ranks():
    pytest.importorskip("timm")
    from examples import deferred_vision

    results = deferred_vision.main(["--nproc", "2", "--model", "timm:vit_tiny_patch16_224"])
    assert [r["identical"] for r in results] == [r["total"] for r in results] and results[0]["total"] > 100
    assert all(r["defaults"] == 0 for r in results)  # every tensor from the model's own constructor
    assert all(0 < r["loss"] < 10 for r in results)


@pytest.mark.parametrize("kind", ["own", "hf"])
def test_first_training_script_is_layout_invariant_and_follows_the_models_init(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    from examples import first_training

    result = first_training.main(["--check", "--model", kind])
    assert result["identical"] == result["tensors"] > 10  # initial weights: 1 rank == 2 ranks, bit for bit
    assert result["losses_close"] and len(result["losses_1"]) == 3
    assert result["defaults"] == []  # every tensor from the model's own constructor
    # the constructor's std=0.02 embedding, not nn.Embedding's N(0, 1) default
    assert abs(result["embedding_std"] - 0.02) < 0.003 and abs(result["eager_embedding_std"] - 0.02) < 0.003
