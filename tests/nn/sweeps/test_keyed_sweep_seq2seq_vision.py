"""keyed() on the encoder-decoder and image-classification architectures of the installed transformers.

As ``tests/nn/sweeps/test_keyed_sweep.py`` does for the language models (issue 22): each ``AutoModelForSeq2SeqLM``
and ``AutoModelForImageClassification`` class (``tests/_support/hf_arch.py``: its default config shrunk, no
hub) is built with every dropout-like probability at :data:`P` (LayerDrop and, for the vision models,
stochastic depth: ``drop_path_rate`` and the like), put in train mode with its BatchNorms on their
running statistics, and run under ``keyinit.nn.keyed`` on a batch of 4, on rows 0:2 and 2:4
(``sample_offset`` 0 and 2) and on each row alone. Checked: the logits of every split equal the whole
batch's (with a tolerance), every dropout module's mask is bitwise the whole batch's, the same modules
run (LayerDrop and DropPath decisions), the keyed draws are live and change with the step, and the
global torch, numpy and Python RNGs are untouched.

An architecture is skipped, with the reason, where its tiny config does not build or run from
``input_ids`` and ``decoder_input_ids`` (seq2seq) or ``pixel_values`` (vision) alone, where it is not
split-invariant even in eval mode, or where its train forward draws nothing. :data:`KNOWN_GAPS` would be
the ones keyed() refuses (strict xfails; none now).

Every architecture runs by default: the whole sweep takes about 25 s on 2 cores (``pytest --durations``,
load average 4). ``KEYINIT_FULL_SWEEP=0`` runs only :data:`REPRESENTATIVE`, chosen for the ways they lay
the batch out (those may not be skipped), as in ``tests/nn/sweeps/test_keyed_sweep.py``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests._support.hf_arch import (  # noqa: E402
    image_classification_architectures,
    seq2seq_architectures,
    tiny_config,
    tiny_vision_config,
)
from tests.nn.sweeps.test_keyed_sweep import SPLITS, TOL, check_keyed_splits  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: The dropout-like probability. Vision models mostly drop whole residual branches (DropPath) behind
#: small layer scales, so 0.3 makes their draws show in a batch of 4.
P = {"seq2seq": 0.1, "vision": 0.3}
MAX_ELEMENTS = 5_000_000

REPRESENTATIVE = {
    "seq2seq": (
        "bart",  # LayerDrop (torch.rand([]) per layer), F.dropout on (B, L, D)
        "t5",  # relative position bias, nn.Dropout modules
        "fsmt",  # sequence-first (L, B, D) activations, (B*H, L, S) attention
        "led",  # input padded to the attention window, global attention
        "pegasus_x",  # global-local attention blocks
        "switch_transformers",  # top-1 MoE: h[None, top_x] per expert, dropout inside experts, index_add_ back
    ),
    "vision": (
        "vit",  # patches, class token expanded to the batch
        "beit",  # DropPath on (B, L, D), relative position bias
        "convnext",  # DropPath on (B, C, H, W) channels-last blocks
        "swinv2",  # windows: the batch merged with the windows
        "segformer",  # efficient attention, DropPath on (B, H*W, C)
        "mobilenet_v2",  # BatchNorm on running statistics, classifier dropout
    ),
}

#: Refused by keyed() (UnkeyedRandomnessError), and why: which sample a row belongs to is decided by values.
KNOWN_GAPS: dict = {}


def _selected() -> list:
    full = os.environ.get("KEYINIT_FULL_SWEEP") != "0"
    params = []
    for kind, every in (("seq2seq", seq2seq_architectures()), ("vision", image_classification_architectures())):
        for t, c in every:
            if not full and t not in REPRESENTATIVE[kind]:
                continue
            marks = [pytest.mark.xfail(reason=KNOWN_GAPS[t], strict=True)] if t in KNOWN_GAPS else []
            params.append(pytest.param(kind, t, c, id=f"{kind}-{t}", marks=marks))
    return params


def test_the_selection_holds_every_representative():
    assert set(REPRESENTATIVE["seq2seq"]) <= {t for t, _ in seq2seq_architectures()}
    assert set(REPRESENTATIVE["vision"]) <= {t for t, _ in image_classification_architectures()}


def _skip(kind: str, model_type: str, reason: str) -> None:
    if model_type in REPRESENTATIVE[kind]:
        pytest.fail(f"{model_type} is representative and may not be skipped: {reason}")
    pytest.skip(f"{model_type}: {reason}")


def _build(kind: str, model_type: str, class_name: str) -> tuple[Any, dict]:
    try:
        if kind == "seq2seq":
            config = tiny_config(model_type, dropout=P[kind])
        else:
            config = tiny_vision_config(model_type, dropout=P[kind])
        cls = getattr(transformers, class_name)
    except Exception as exc:  # noqa: BLE001 - the shrunk config is not valid for this architecture
        _skip(kind, model_type, f"no tiny config ({type(exc).__name__})")
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                probe = cls(config)
            elements = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
            del probe
            if elements > MAX_ELEMENTS:
                _skip(kind, model_type, f"{elements} elements (at most {MAX_ELEMENTS} here)")
            torch.manual_seed(0)
            model = cls(config)
        except pytest.skip.Exception:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers' own failure on a tiny config
            _skip(kind, model_type, f"the tiny config does not build ({type(exc).__name__}: {str(exc)[:80]})")
    if kind == "seq2seq":
        vocab = max(int(getattr(config, "vocab_size", None) or 64) - 4, 2)
        batch = {"input_ids": (torch.arange(32).reshape(4, 8) * 7 + 3) % vocab + 4,
                 "decoder_input_ids": (torch.arange(24).reshape(4, 6) * 5 + 1) % vocab + 4}
    else:
        channels = getattr(getattr(config, "vision_config", config), "num_channels", 3)
        pixels = torch.linspace(-1, 1, 4 * channels * 32 * 32).reshape(4, channels, 32, 32)
        batch = {"pixel_values": pixels[torch.tensor([2, 0, 3, 1])]}
    return model, batch


def _logits(model: Any, batch: dict) -> torch.Tensor:
    out = model(**batch)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out[0]


def _rows(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi] for k, v in batch.items()}


@pytest.mark.parametrize("kind,model_type,class_name", _selected())
def test_keyed_training_forward_is_split_invariant(kind, model_type, class_name):
    model, batch = _build(kind, model_type, class_name)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.eval()
        try:
            eval_whole = _logits(model, batch)
            eval_parts = torch.cat([_logits(model, _rows(batch, lo, hi)) for lo, hi in SPLITS[0]])
        except Exception as exc:  # noqa: BLE001 - needs other inputs (audio features, images, ...)
            _skip(kind, model_type, f"does not run from {sorted(batch)} ({type(exc).__name__}: {str(exc)[:80]})")
        if not torch.allclose(eval_whole, eval_parts, **TOL):
            _skip(kind, model_type, "not split-invariant even in eval mode (max |diff| "
                  f"{(eval_whole - eval_parts).abs().max().item():.3g})")
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()  # running statistics: batch statistics mix the samples
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            if torch.equal(_logits(model, batch), eval_whole):
                _skip(kind, model_type, "its train forward draws nothing (no dropout-like op)")

        check_keyed_splits(model, lambda rows: _logits(model, batch if rows is None else _rows(batch, *rows)),
                           SPLITS, eval_whole, model_type, differs=lambda a, b: not torch.equal(a, b))
