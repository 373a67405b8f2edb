"""Keep your init code: run torchtitan- or HF-style init methods keyed, unchanged.

    python examples/existing_init_code.py
    python -m keyinit verify examples.existing_init_code:titan_model --init-method init_weights
    python -m keyinit verify examples.existing_init_code:hf_model_with_padding_rule

Two models carry their own init code, written the usual way with
``torch.nn.init`` and the global RNG, and are NOT modified:

* ``TitanTransformer``: torchtitan style, ``model.init_weights()`` calls
  ``init_weights`` of its blocks (``trunc_normal_`` with depth-scaled std,
  ``normal_`` embedding, ``reset_parameters`` of norms).
* ``HFLikeModel``: Hugging Face style, ``_init_weights(module)`` applied to
  every module (``weight.data.normal_(0, initializer_range)``, zero biases,
  LayerNorm ones/zeros, zero padding row).

``keyinit.init_model(model, seed, init_method="init_weights")`` (or
``init_method=model._init_weights``) captures that code once, on stand-ins with
each tensor's GLOBAL shape, and replays it for the region each process holds:
every draw is keyed by the tensor it lands in, so the values no longer depend
on the global RNG (``torch.manual_seed`` is irrelevant), the order modules are
visited, or the layout. Even ``weight.data[padding_idx].zero_()`` is right
under every layout: the row index is applied to the global tensor, and each
shard that holds that row zeroes it.

Layout invariance is shown with the in-process check of ``keyinit verify``
(simulated FSDP, TP, FSDP x TP and pipeline ranks), which runs the same capture
and replay as a real run. A keyinit rule still outranks the init method, for
the tensors it names: ``hf_model_with_padding_rule`` gives the embedding
``init.with_zero_rows(init.normal(std=...), padding_idx)`` without touching the model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

import keyinit  # noqa: E402
from keyinit import init  # noqa: E402

# --------------------------------------------------------------------------- torchtitan style


class TitanAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, layer_id: int, dim: int, n_heads: int, hidden: int, n_layers: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = TitanAttention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = TitanFeedForward(dim, hidden)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32, n_layers: int = 2, n_heads: int = 4, hidden: int = 86) -> None:
        super().__init__()
        self.dim = dim
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(i, dim, n_heads, hidden, n_layers) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        final_out_std = self.dim ** -0.5
        cutoff_factor = 3
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=final_out_std,
                                  a=-cutoff_factor * final_out_std, b=cutoff_factor * final_out_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


# --------------------------------------------------------------------------- Hugging Face style


@dataclass
class HFConfig:
    vocab_size: int = 101
    hidden_size: int = 24
    intermediate_size: int = 70
    num_hidden_layers: int = 2
    initializer_range: float = 0.02
    pad_token_id: int = 3


class HFLayer(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)


class HFLikeModel(nn.Module):
    """What ``PreTrainedModel`` subclasses look like: ``_init_weights(module)`` applied to every module."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(HFLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)


# --------------------------------------------------------------------------- factories for `keyinit verify`


def titan_model():
    return TitanTransformer(), {"init_method": "init_weights"}


def hf_model():
    model = HFLikeModel(HFConfig())
    return model, {"init_method": model._init_weights}


def hf_model_with_padding_rule():
    """The HF model plus ONE keyinit rule for the padding row; the model code is unchanged."""
    model = HFLikeModel(HFConfig())
    embedding = init.with_zero_rows(init.normal(std=model.config.initializer_range), model.config.pad_token_id)
    return model, {"init_method": model._init_weights, "rules": {"embed_tokens.weight": embedding}}


def main(argv: list[str] | None = None) -> dict[str, bool]:
    from keyinit.cli.verify import verify

    layouts = ["fsdp4", "tp2", "fsdp2xtp2", "pp2"]
    results = {}

    # The init code is keyed: the global RNG state does not matter.
    a, kw = titan_model()
    torch.manual_seed(1)
    keyinit.init_model(a, 0, **kw)
    b, kw = titan_model()
    torch.manual_seed(2)
    keyinit.init_model(b, 0, **kw)
    same = all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    print(f"torchtitan-style init_weights, keyed: independent of torch.manual_seed: {same}")
    print(f"  output.weight std {float(a.output.weight.detach().std()):.4f} (asked for {a.dim ** -0.5:.4f}, truncated at 3 std)")
    results["titan seed-independent"] = same

    for name, factory, expect_ok in (("titan_model", titan_model, True), ("hf_model", hf_model, True),
                                     ("hf_model_with_padding_rule", hf_model_with_padding_rule, True)):
        result = verify(factory, layouts, seed=0, progress=False)
        diffs = sorted({(p["fqn"], layout) for p in result["params"] for layout in p["bad"]})
        print(f"{name}: layouts {', '.join(layouts)}: "
              + ("every rank bit-identical to one process" if result["ok"] else
                 "DIFFERS: " + "; ".join(f"{fqn} under {layout}" for fqn, layout in diffs)))
        results[name] = result["ok"] == expect_ok
    return results


if __name__ == "__main__":
    sys.exit(0 if all(main().values()) else 1)
