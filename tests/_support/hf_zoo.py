"""A zoo of tiny Hugging Face transformers models, built from config objects on the meta device.

No hub access: every model is built in code from a config (``HF_HUB_OFFLINE=1``
is set before transformers is imported). Sizes are tiny and odd on purpose, so
that FSDP2 over 4 ranks and TP over 2 shard unevenly and some ranks hold empty
shards: hidden 18 (3 heads of 6, one KV head of 6), FFN 37, vocab 67, 3 experts.
Where a model has a ``pad_token_id``, it points at a row that no rank holds at
the same local index (row 40 of 67 lands on FSDP rank 2 as local row 6).

API
---
- :data:`ZOO`: ``{name: ZooModel}``; :data:`NAMES`: the acceptance zoo (CLIP excluded,
  it is the model ``_init_weights`` cannot fully cover; see :data:`CLIP`).
- ``ZooModel.build(device="meta")`` builds the model (on meta by default; the test's
  HF reference builds it on CPU, where HF's own init runs in the constructor).
- :func:`fsdp_wrap` (``fully_shard`` per block, then the root), :func:`tp_plan`
  (ColwiseParallel/RowwiseParallel by leaf Linear/Embedding name).
"""

from __future__ import annotations

import copy
import math
import os
import types
from collections.abc import Mapping
from typing import Any, Optional

import attrs
import torch
from torch import nn

__all__ = ["ZooModel", "ZOO", "NAMES", "CLIP", "build", "fsdp_wrap", "tp_plan", "blocks", "init_std"]

VOCAB = 67
PAD = 40  # row 40 of 67: FSDP over 4 ranks puts it on rank 2 as local row 6; TP over 2 on rank 1 as local row 6
HIDDEN = 18
HEADS = 3
HEAD_DIM = 6
FFN = 37
LAYERS = 2
POSITIONS = 32


def _transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"  # no hub access here: every model is built from a config
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from tests._support.vision import define_torchvision_schemas

    define_torchvision_schemas()  # transformers imports torchvision when it is installed
    import transformers

    return transformers


def _frozen_mapping(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(value))


@attrs.frozen(eq=False)
class ZooModel:
    """One zoo entry: a model class from transformers and the config that makes it tiny.

    ``std_overrides``: ``{fnmatch pattern of a weight FQN: expected std or None}`` for the
    Linear/Embedding weights whose ``_init_weights`` does not use the config's
    ``initializer_range``/``init_std`` (None: not a plain normal, checked only against HF's
    own init). ``pad_rows``: ``{weight FQN: padding row}`` that HF zeroes.
    """

    name: str
    model_class: str
    config_class: str
    config: Mapping[str, Any] = attrs.field(converter=_frozen_mapping)
    std_overrides: Mapping[str, Optional[float]] = attrs.field(factory=dict, converter=_frozen_mapping)
    pad_rows: Mapping[str, int] = attrs.field(factory=dict, converter=_frozen_mapping)
    sub_configs: Mapping[str, tuple[str, Mapping[str, Any]]] = attrs.field(factory=dict, converter=_frozen_mapping)

    def make_config(self) -> Any:
        tf = _transformers()
        kwargs = copy.deepcopy(dict(self.config))  # configs may mutate what they are given (rope_parameters)
        for field, (cls, sub) in self.sub_configs.items():
            kwargs[field] = getattr(tf, cls)(**sub)
        return getattr(tf, self.config_class)(**kwargs)

    def build(self, device: str = "meta") -> nn.Module:
        """The model, built under ``torch.device(device)`` (meta: no memory, HF skips its init)."""
        tf = _transformers()
        config = self.make_config()
        with torch.device(device):
            model = getattr(tf, self.model_class)(config)
        return model


def _decoder(**extra: Any) -> dict[str, Any]:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=POSITIONS,
                initializer_range=0.02)
    base.update(extra)
    return base


def _t5_stds() -> dict[str, Optional[float]]:
    d_model, d_kv, heads, d_ff = HIDDEN, HEAD_DIM, HEADS, FFN
    return {
        "shared.weight": 1.0, "encoder.embed_tokens.weight": 1.0, "decoder.embed_tokens.weight": 1.0,
        "lm_head.weight": 1.0,
        "*.SelfAttention.q.weight": (d_model * d_kv) ** -0.5, "*.EncDecAttention.q.weight": (d_model * d_kv) ** -0.5,
        "*.SelfAttention.k.weight": d_model ** -0.5, "*.EncDecAttention.k.weight": d_model ** -0.5,
        "*.SelfAttention.v.weight": d_model ** -0.5, "*.EncDecAttention.v.weight": d_model ** -0.5,
        "*.SelfAttention.o.weight": (heads * d_kv) ** -0.5, "*.EncDecAttention.o.weight": (heads * d_kv) ** -0.5,
        "*.relative_attention_bias.weight": d_model ** -0.5,
        "*.DenseReluDense.wi.weight": d_model ** -0.5, "*.DenseReluDense.wo.weight": d_ff ** -0.5,
    }


def _mamba_stds() -> dict[str, Optional[float]]:
    inner = 2 * HIDDEN
    dt_rank = 3
    return {
        # kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(fan_in)), std 1/sqrt(3 fan_in)
        "*.mixer.out_proj.weight": 1.0 / math.sqrt(3 * inner),
        # time_step_init_scheme="random": U(+-dt_rank**-0.5 * time_step_scale)
        "*.mixer.dt_proj.weight": dt_rank ** -0.5 / math.sqrt(3),
    }


_ENTRIES = [
    ZooModel("llama", "LlamaForCausalLM", "LlamaConfig", _decoder(head_dim=HEAD_DIM, pad_token_id=None)),
    ZooModel("llama_pad", "LlamaForCausalLM", "LlamaConfig", _decoder(head_dim=HEAD_DIM, pad_token_id=PAD),
             pad_rows={"model.embed_tokens.weight": PAD}),
    ZooModel("llama_tied", "LlamaForCausalLM", "LlamaConfig",
             _decoder(head_dim=HEAD_DIM, pad_token_id=None, tie_word_embeddings=True)),
    ZooModel("qwen3", "Qwen3ForCausalLM", "Qwen3Config", _decoder(head_dim=HEAD_DIM, pad_token_id=None)),
    ZooModel("gemma", "GemmaForCausalLM", "GemmaConfig", _decoder(head_dim=HEAD_DIM, pad_token_id=PAD),
             pad_rows={"model.embed_tokens.weight": PAD}),
    ZooModel("phi3", "Phi3ForCausalLM", "Phi3Config",
             _decoder(pad_token_id=PAD, bos_token_id=1, eos_token_id=2, original_max_position_embeddings=POSITIONS),
             pad_rows={"model.embed_tokens.weight": PAD}),
    ZooModel("mixtral", "MixtralForCausalLM", "MixtralConfig",
             _decoder(head_dim=HEAD_DIM, pad_token_id=None, num_local_experts=3, num_experts_per_tok=2)),
    ZooModel("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
             _decoder(pad_token_id=PAD, bos_token_id=None, eos_token_id=2, num_experts=3, num_experts_per_tok=2),
             pad_rows={"model.embed_tokens.weight": PAD}),
    ZooModel("gpt2", "GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
                  initializer_range=0.02, bos_token_id=1, eos_token_id=2)),
    ZooModel("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig",
             dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=LAYERS, num_attention_heads=2,
                  intermediate_size=FFN, max_position_embeddings=POSITIONS, initializer_range=0.02,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  bos_token_id=1, eos_token_id=2)),
    ZooModel("opt", "OPTForCausalLM", "OPTConfig",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, ffn_dim=FFN,
                  num_attention_heads=HEADS, max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN,
                  init_std=0.02, pad_token_id=PAD, bos_token_id=1, eos_token_id=2),
             pad_rows={"model.decoder.embed_tokens.weight": PAD}),
    ZooModel("bert", "BertForMaskedLM", "BertConfig",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, max_position_embeddings=POSITIONS, type_vocab_size=2,
                  initializer_range=0.02, pad_token_id=PAD),
             pad_rows={"bert.embeddings.word_embeddings.weight": PAD}),
    # RoBERTa's position embeddings share padding_idx = pad_token_id: 37 positions, pad row 23 on FSDP rank 2.
    ZooModel("roberta", "RobertaForMaskedLM", "RobertaConfig",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=FFN, max_position_embeddings=37, type_vocab_size=1,
                  initializer_range=0.02, pad_token_id=23, bos_token_id=0, eos_token_id=2),
             pad_rows={"roberta.embeddings.word_embeddings.weight": 23,
                       "roberta.embeddings.position_embeddings.weight": 23}),
    ZooModel("t5", "T5ForConditionalGeneration", "T5Config",
             dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_DIM, d_ff=FFN, num_layers=LAYERS,
                  num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                  relative_attention_max_distance=16, initializer_factor=1.0, pad_token_id=0,
                  eos_token_id=1, decoder_start_token_id=0),
             std_overrides=_t5_stds()),
    ZooModel("bart", "BartForConditionalGeneration", "BartConfig",
             dict(vocab_size=VOCAB, max_position_embeddings=POSITIONS, encoder_layers=LAYERS, decoder_layers=LAYERS,
                  encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, d_model=HIDDEN, init_std=0.02, pad_token_id=PAD,
                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2),
             pad_rows={"model.shared.weight": PAD}),
    ZooModel("whisper", "WhisperForConditionalGeneration", "WhisperConfig",
             dict(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=LAYERS, decoder_layers=LAYERS,
                  encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                  decoder_ffn_dim=FFN, d_model=HIDDEN, init_std=0.02, max_source_positions=15,
                  max_target_positions=POSITIONS, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[]),
             # the sinusoid table is deterministic (checked against HF's), not a normal draw
             std_overrides={"model.encoder.embed_positions.weight": None},
             pad_rows={"model.decoder.embed_tokens.weight": PAD}),
    ZooModel("vit", "ViTForImageClassification", "ViTConfig",
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                  image_size=8, patch_size=4, num_channels=3, initializer_range=0.02, num_labels=5)),
    ZooModel("convnext", "ConvNextForImageClassification", "ConvNextConfig",
             dict(num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[12, 22], depths=[1, 1],
                  initializer_range=0.02, layer_scale_init_value=0.5, image_size=8, num_labels=5)),
    ZooModel("resnet", "ResNetForImageClassification", "ResNetConfig",
             dict(num_channels=3, embedding_size=12, hidden_sizes=[12, 22], depths=[1, 1], layer_type="basic",
                  num_labels=5),
             # kaiming_uniform_(a=sqrt(5)) on the classifier: U(+-1/sqrt(22)), std 1/sqrt(3*22)
             std_overrides={"classifier.1.weight": 1.0 / math.sqrt(3 * 22)}),
    ZooModel("mamba", "MambaForCausalLM", "MambaConfig",
             dict(vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4, num_hidden_layers=LAYERS, expand=2,
                  conv_kernel=3, time_step_rank=3, initializer_range=0.02, pad_token_id=0, bos_token_id=0,
                  eos_token_id=0),
             std_overrides=_mamba_stds()),
]

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _ENTRIES}
NAMES: tuple[str, ...] = tuple(ZOO)

#: CLIP: ``_init_weights`` never touches ``logit_scale`` (HF relies on the constructor's value).
CLIP = ZooModel(
    "clip", "CLIPModel", "CLIPConfig", dict(projection_dim=10, logit_scale_init_value=2.6592),
    sub_configs={
        "text_config": ("CLIPTextConfig", dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                               num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                               max_position_embeddings=POSITIONS, projection_dim=10)),
        "vision_config": ("CLIPVisionConfig", dict(hidden_size=HIDDEN, intermediate_size=FFN,
                                                   num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                   image_size=8, patch_size=4, projection_dim=10)),
    },
)


def build(name: str, device: str = "meta") -> nn.Module:
    """Zoo model ``name`` (``"clip"`` included), built on ``device``."""
    return (CLIP if name == "clip" else ZOO[name]).build(device)


def init_std(model: nn.Module) -> float:
    """The std HF's generic ``_init_weights`` gives Linear/Embedding weights (``initializer_range``/``init_std``)."""
    config = model.config
    for field in ("initializer_range", "init_std", "initializer_factor"):
        value = getattr(config, field, None)
        if value is not None:
            return float(value)
    return 0.02


# ----------------------------------------------------------------------------- parallel layouts
def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer/conv blocks: items of the outermost ``nn.ModuleList``s that hold parameters."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                for item in child:
                    if any(True for _ in item.parameters()):
                        found.append(item)
            else:
                visit(child)

    visit(model)
    return found


def fsdp_wrap(model: nn.Module, mesh: Any = None) -> nn.Module:
    """FSDP2: ``fully_shard`` every block (:func:`blocks`), then the root."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mesh is None else {"mesh": mesh}
    for block in blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


#: Leaf names that get RowwiseParallel (the "output" projections); other Linears get ColwiseParallel.
_ROWWISE = frozenset({"o_proj", "down_proj", "out_proj", "fc2", "wo", "o", "dense_4h_to_h", "fc_out",
                      "pwconv2", "w2"})


def _shared_parameter_modules(model: nn.Module) -> set[int]:
    """Modules that hold a parameter some other module also holds (tied weights)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    return {id(m) for ms in owners.values() if len(ms) > 1 for m in ms}


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """A TP plan that gives real DTensor placements (the forward is never run, only init).

    Every leaf ``nn.Embedding`` gets RowwiseParallel (Shard(0): padding rows land on one
    rank) and every leaf ``nn.Linear`` ColwiseParallel (Shard(0) weight and bias) or, for
    output projections (:data:`_ROWWISE`), RowwiseParallel (Shard(1) weight, replicated
    bias). Modules TP cannot shard (Conv, Conv1D, norms, fused expert tensors) and modules
    with a tied weight (sharding would untie it) stay replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    tied = _shared_parameter_modules(model)
    plan: dict[str, Any] = {}
    for fqn, module in model.named_modules():
        if not fqn or id(module) in tied or any(True for _ in module.children()):
            continue
        if type(module) is nn.Embedding:
            plan[fqn] = RowwiseParallel()
        elif type(module) is nn.Linear:
            rowwise = fqn.rsplit(".", 1)[-1] in _ROWWISE or fqn.endswith("output.dense")  # BERT/RoBERTa
            plan[fqn] = RowwiseParallel() if rowwise else ColwiseParallel()
    return plan

