"""The example models: a small Llama-like transformer and a small conv net.

The definitions live in :mod:`keyinit.cli.models` so that ``keyinit demo``
works from an installed package; read that file for the code. In short:

* ``Transformer(ModelArgs)`` / ``llama(model_size)``: ``tok_embeddings``
  (nn.Embedding), ``layers.<i>`` (an nn.ModuleDict of blocks: ``attention_norm``
  and ``ffn_norm`` (nn.RMSNorm), ``attention.wq/wk/wv/wo``, SwiGLU
  ``feed_forward.w1/w2/w3``), ``norm``, ``output``; torchtitan's FQNs.
* ``ConvNet`` / ``convnet(model_size)``: Conv2d + BatchNorm2d blocks and a Linear head.
* ``llama_rules(args)``: Llama-style init as keyinit FQN rules.
* ``tp_plan(model)``: the tensor-parallel plan; ``pipeline_stage(model, stage, n)``:
  cut a model to a pipeline stage in place, keeping FQNs.

Both models are meta-device friendly. ``model_size`` is ``tiny``, ``small``,
``medium``, ``large`` (and ``llama3-8b`` for the transformer, meta only).

This module also holds ready-made factories for the command line::

    python -m keyinit verify examples.models:tiny_llama
    python -m keyinit slice examples.models:tiny_llama_with_rules 'output.weight[0:2, :4]' --seed 0
"""

from __future__ import annotations

from keyinit.cli.models import (  # noqa: F401 - re-exported
    SIZES,
    TP_ROWWISE,
    Attention,
    ConvNet,
    FeedForward,
    ModelArgs,
    Transformer,
    TransformerBlock,
    convnet,
    llama,
    llama_rules,
    pipeline_stage,
    tp_plan,
)

__all__ = [
    "ModelArgs", "SIZES", "Transformer", "TransformerBlock", "Attention", "FeedForward", "ConvNet",
    "llama", "llama_rules", "convnet", "tp_plan", "pipeline_stage", "TP_ROWWISE",
    "tiny_llama", "tiny_llama_tied", "tiny_llama_with_rules", "small_llama", "tiny_convnet", "llama3_8b",
]


def tiny_llama() -> Transformer:
    """The tiny Llama with torch.nn's default initialization (no rules)."""
    return llama("tiny")


def tiny_llama_tied() -> Transformer:
    """The tiny Llama with the output projection tied to the token embedding."""
    return llama("tiny", tie_embeddings=True)


def tiny_llama_with_rules():
    """A factory may return ``(model, init_model_kwargs)``: here, the Llama-style rules."""
    model = llama("tiny")
    return model, {"rules": llama_rules(model.args)}


def small_llama():
    model = llama("small")
    return model, {"rules": llama_rules(model.args)}


def tiny_convnet() -> ConvNet:
    return convnet("tiny")


def llama3_8b():
    """Llama-3-8B's shapes (8.0 B parameters): build it on the meta device only."""
    model = llama("llama3-8b")
    return model, {"rules": llama_rules(model.args)}
