"""Dynamic right padding under ``keyed(..., stream="v2")`` on HF causal and masked LMs (issue 33): a sample's real
tokens get the same logits and dropout masks in the whole batch, in a part padded to its own longest, and alone
(a batch of one), on a representative subset of architectures; stream v1 is the control that differs.

``tests/_support/hf_padding.py`` is the check (tiny 2-layer configs, dropout 0.1 everywhere, real lengths 11/6/9/3
right-padded with an attention mask; real-token logits with a tolerance of 1e-5, every dropout kernel call's
mask bitwise); ``benchmarks/sweep_padding.py`` runs it over every architecture of the installed transformers.
The subset may not be skipped: an architecture of it that stops building or running fails here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests._support.hf_arch import lm_architectures  # noqa: E402
from tests._support.hf_padding import SPLITS, check  # noqa: E402

#: Chosen for the ways they lay out the batch and its tokens where they draw.
REPRESENTATIVE = (
    "bert",  # (B, L, D) dropouts, eager (B, H, L, L) attention-probability dropout
    "roberta",  # padding-aware position ids
    "gpt2",  # Conv1D projections (addmm on (B*L, D)), residual and attention dropout
    "llama",  # SDPA with dropout_p > 0, rotary embeddings
    "mistral",  # sliding-window SDPA, grouped-query attention
    "qwen2",  # grouped-query attention with biases
    "opt",  # dropout on (B*L, D) flattened rows
    "bart",  # BART-style decoder (LayerDrop's per-layer draw)
    "whisper",  # an encoder-decoder's decoder alone, learned positions
    "xlnet",  # sequence-first (L, B, D) activations, einsum attention
    "gpt_neox",  # fused QKV, parallel residual
    "mixtral",  # MoE: tokens sorted by expert (grouped matmul), top-2 copies weighted and summed back
    "qwen2_moe",  # MoE with a shared expert and its gate
    "olmoe",  # MoE, QK-norm
)


def _class(model_type: str) -> str:
    return dict(lm_architectures())[model_type]


def test_the_subset_exists():
    types = {t for t, _ in lm_architectures()}
    assert set(REPRESENTATIVE) <= types, sorted(set(REPRESENTATIVE) - types)


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_v2_keeps_every_real_tokens_logits_and_masks(model_type):
    outcome = check(model_type, _class(model_type), "v2")
    assert outcome.kind == "kept", f"{model_type}: {outcome.kind}: {outcome.reason}"
    assert outcome.layers == 2, model_type  # what a layer hands the next is checked too
    assert outcome.compared > 0, f"{model_type}: no dropout kernel call was compared"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_moe_sample_alone_is_keyed_as_inside_the_batch(model_type):
    """A micro-batch of one sample (each sample alone, its own length): keyed, not refused, with the masks and
    logits of the same sample in the padded batch of 4 (the second layer's attention dropout reads what the
    first layer's experts gave back)."""
    outcome = check(model_type, _class(model_type), "v2", splits=SPLITS[1:])
    assert outcome.kind == "kept", f"{model_type}: {outcome.kind}: {outcome.reason}"
    assert outcome.layers == 2 and outcome.compared >= 4, (outcome.layers, outcome.compared)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_v1_is_the_control_its_masks_depend_on_the_padding(model_type):
    outcome = check(model_type, _class(model_type), "v1")
    assert outcome.kind == "differ", f"{model_type}: {outcome.kind}: {outcome.reason}"
    assert outcome.masks_differ > 0 and outcome.logits_differ > 0, outcome
