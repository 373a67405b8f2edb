"""Every architecture the installed transformers offers, built from a tiny config (no hub).

``architectures()`` lists ``(model_type, class name)``: one model class per ``model_type`` of the
auto mappings, the first of causal LM, masked LM and base model that it has (the heads are where
ties and aliases live). ``tiny_factory(model_type, class_name)`` gives a factory that builds it
from the architecture's default config shrunk field by field (:data:`SMALL`, sub-configs too), or
raises ``ValueError`` when the shrunk config cannot be made. Used by ``tests/zoo/test_hf_sweep.py``
and ``benchmarks/sweep_deferred.py``.

``lm_architectures()`` lists the causal-LM and masked-LM classes (one per ``model_type``, causal
first) and ``tiny_config(model_type, dropout=p)`` gives the shrunk config with every dropout-like
probability set to ``p``: used by ``tests/nn/sweeps/test_keyed_sweep.py``.
"""

from __future__ import annotations

from typing import Any, Callable

SMALL = dict(hidden_size=16, num_hidden_layers=1, num_layers=1, intermediate_size=24, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
             max_position_embeddings=32, head_dim=8, n_embd=16, n_layer=1, n_head=2, d_ff=24, num_heads=2,
             ffn_dim=24, embed_dim=16, num_experts=2, n_routed_experts=2, num_local_experts=2,
             moe_intermediate_size=8, hidden_sizes=[8, 16], depths=[1, 1], embedding_size=16, projection_dim=8,
             num_channels=3, image_size=16, patch_size=4)

#: The head classes tried per model_type, in order, then the base model.
MAPPINGS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


def architectures() -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto

    chosen: dict[str, str] = {}
    for mapping in MAPPINGS:
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            if isinstance(class_name, (tuple, list)):
                class_name = class_name[0]
            chosen.setdefault(model_type, class_name)
    return sorted(chosen.items())


def lm_architectures() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every causal-LM and masked-LM head (causal first per model_type)."""
    from transformers.models.auto import modeling_auto

    chosen: dict[str, str] = {}
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        for model_type, class_name in getattr(modeling_auto, mapping).items():
            chosen.setdefault(model_type, class_name[0] if isinstance(class_name, (tuple, list)) else class_name)
    return sorted(chosen.items())


def is_dropout_field(name: str) -> bool:
    """A config field that is a dropout-like probability: ``*dropout*``, ``*_pdrop``, ``*layerdrop``."""
    return "dropout" in name or name.endswith("_pdrop") or name.endswith("layerdrop")


def set_dropout(config: Any, p: float, transformers: Any) -> list[str]:
    """Set every numeric dropout-like field of ``config`` and its sub-configs to ``p``; the names set."""
    done: list[str] = []
    for name, value in list(vars(config).items()):
        if isinstance(value, transformers.PretrainedConfig):
            done += [f"{name}.{n}" for n in set_dropout(value, p, transformers)]
        elif is_dropout_field(name) and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                setattr(config, name, p)
                done.append(name)
            except Exception:  # noqa: BLE001 - a config that validates its fields
                pass
    return done


def tiny_config(model_type: str, dropout: float | None = None) -> Any:
    """The shrunk default config of ``model_type`` (every dropout-like probability ``dropout`` if given)."""
    import transformers

    config = _shrink(transformers.AutoConfig.for_model(model_type), transformers)
    for inner in (config, getattr(config, "text_config", None)):
        # a router picks at most the 2 experts SMALL leaves (the default top-k of 4 to 8 cannot run)
        if isinstance(getattr(inner, "num_experts_per_tok", None), int) and inner.num_experts_per_tok > 2:
            inner.num_experts_per_tok = 2
        if isinstance(getattr(inner, "shared_expert_intermediate_size", None), int):
            inner.shared_expert_intermediate_size = 24
        if isinstance(getattr(inner, "rotary_dim", None), int):  # GPT-J, CodeGen: 64 of SMALL's head_dim of 8
            inner.rotary_dim = 4
        if isinstance(getattr(inner, "qk_rope_head_dim", None), int):
            # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): SMALL's head_dim of 8 split into a
            # rotary and a plain half, latent ranks to match (the defaults' 64 + 128 do not fit head_dim 8)
            for name, value in (("qk_rope_head_dim", 4), ("qk_nope_head_dim", 4), ("v_head_dim", 8),
                                ("kv_lora_rank", 8), ("q_lora_rank", 8), ("head_dim", 4)):
                if hasattr(inner, name):
                    setattr(inner, name, value)
        if inner is not None and getattr(inner, "use_cache", None):
            inner.use_cache = False  # a training forward keeps no cache (hybrid caches refuse input_ids alone)
    if dropout is not None:
        set_dropout(config, dropout, transformers)
    return config


def _shrink(config: Any, transformers: Any) -> Any:
    for name, value in SMALL.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except Exception:  # noqa: BLE001 - a config that validates its fields
                pass
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int):  # a padding id of the full vocabulary (ModernBERT's 50283) into the tiny one
        for name, value in list(vars(config).items()):
            if name.endswith("pad_token_id") and isinstance(value, int) and value >= vocab:
                try:
                    setattr(config, name, value % vocab)
                except Exception:  # noqa: BLE001 - a config that validates its fields
                    pass
    for sub in ("text_config", "vision_config", "audio_config", "encoder", "decoder"):
        inner = getattr(config, sub, None)
        if isinstance(inner, transformers.PretrainedConfig):
            _shrink(inner, transformers)
    return config


def tiny_factory(model_type: str, class_name: str) -> Callable[[], Any]:
    import transformers

    try:
        config = _shrink(transformers.AutoConfig.for_model(model_type), transformers)
        cls = getattr(transformers, class_name)
    except Exception as exc:  # noqa: BLE001 - the shrunk config is not valid for this architecture
        raise ValueError(f"{model_type}: no tiny config ({type(exc).__name__}: {exc})") from None

    def build() -> Any:
        return cls(config)

    build.__qualname__ = f"{class_name}(tiny {model_type} config)"
    return build


# ----------------------------------------------------------------------------- encoder-decoders, image classifiers


def seq2seq_architectures() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every ``AutoModelForSeq2SeqLM`` head."""
    from transformers.models.auto import modeling_auto

    return _first_classes(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def image_classification_architectures() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every ``AutoModelForImageClassification`` head."""
    from transformers.models.auto import modeling_auto

    return _first_classes(modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)


def _first_classes(mapping: Any) -> list[tuple[str, str]]:
    return sorted((t, c[0] if isinstance(c, (tuple, list)) else c) for t, c in mapping.items())


#: Per-stage lists of a vision config: block counts (set to 1), widths (divided by 8, at least 8: one
#: map for every field, so a stage's in_channels stay the previous stage's out_channels) and heads (1).
_STAGE_COUNTS = ("depths", "depth", "num_block_repeats", "stage_num_blocks", "n_attn_blocks", "num_blocks")
_STAGE_WIDTHS = ("hidden_sizes", "embed_dim", "embed_dims", "in_channels", "out_channels", "stage_in_channels",
                 "stage_mid_channels", "stage_out_channels", "base_attn_unit_dims", "neck_hidden_sizes")
_STAGE_HEADS = ("num_heads", "num_attention_heads")
#: Stochastic-depth and dropout-like fields of vision configs, beyond :func:`is_dropout_field`'s.
_VISION_DROPS = ("drop_path_rate", "drop_rate", "attention_drop_rate", "stochastic_depth_prob", "drop_connect_rate")


def tiny_vision_config(model_type: str, dropout: float | None = None, image_size: int = 32) -> Any:
    """The default config of an image classifier, shrunk stage by stage (every stage kept, one block
    each, narrow, one head; ``image_size`` pixels; patches of 4), every dropout-like and
    stochastic-depth probability ``dropout`` if given. Raises what transformers raises for a config it
    refuses."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    for inner in (config, getattr(config, "vision_config", None)):
        if isinstance(inner, transformers.PretrainedConfig):
            _shrink_vision(inner, image_size, dropout, transformers)
    if dropout is not None:
        set_dropout(config, dropout, transformers)
    return config


#: Scalar sizes of a vision config (ViT-style encoders), shrunk as :data:`SMALL` shrinks a language model's.
_VISION_SCALARS = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24,
                       patch_size=4, embed_dim=16, num_heads=2, projection_dim=8, vocab_size=64,
                       max_position_embeddings=32, num_groups=2)


def _shrink_vision(config: Any, image_size: int, dropout: float | None, transformers: Any) -> None:
    for name, value in list(vars(config).items()):
        new = _VISION_SCALARS.get(name) if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in value):
            if name in _STAGE_COUNTS:
                new = [1] * len(value)
            elif name in _STAGE_WIDTHS:
                new = [max(8, v // 8) for v in value]
            elif name in _STAGE_HEADS:
                new = [1] * len(value)
            elif name == "image_size":
                new = [image_size] * len(value)
        elif isinstance(value, int) and not isinstance(value, bool) and name in _STAGE_COUNTS:
            new = 1
        elif name == "image_size" and isinstance(value, int):
            new = image_size
        if dropout is not None and name in _VISION_DROPS:
            if isinstance(value, (list, tuple)):
                new = [dropout] * len(value)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                new = dropout
        if new is not None:
            try:
                setattr(config, name, type(value)(new) if isinstance(value, tuple) else new)
            except Exception:  # noqa: BLE001 - a config that validates its fields
                pass
    if isinstance(getattr(config, "window_size", None), int):
        config.window_size = 2  # Swin-style windows over the tiny image's patches
