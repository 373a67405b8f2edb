"""keyed() on the causal-LM and masked-LM architectures of the installed transformers (issue 22).

Each architecture (``tests/_support/hf_arch.py``: one class per ``model_type``, its default config shrunk
to a tiny one, no hub) is built with every dropout-like probability at 0.1 (``*dropout*``,
``*_pdrop``, ``*layerdrop``: LayerDrop included), put in train mode with its BatchNorms on their
running statistics, and run under ``keyinit.nn.keyed(model, 0, step=0)`` on a batch of 4 token
sequences and again on rows 0:2 and 2:4 with ``sample_offset`` 0 and 2 (:data:`REPRESENTATIVE`: also
on each row alone, a forward of one row, where a size-1 batch is easily taken for a broadcast).
Checked:

* the logits of every split equal the whole batch's (torch's matmuls are not batch-invariant:
  with a tolerance);
* every dropout module's mask (``out == 0`` where ``in != 0``, read by a forward hook) is
  bitwise the whole batch's, joined along the dimension the halves split; and the modules run
  are the same in every forward (a LayerDrop decision is the same for every split);
* dropout is live (the logits are not the eval logits), step 1 gives other logits than step 0,
  and the global torch, numpy and Python RNGs are untouched;
* no two draws of the whole batch's forward share a key (a module run twice numbers its calls on:
  T5-style shared dropout modules).

An architecture is skipped, with the reason, when its tiny config does not build or run from
``input_ids`` alone, when it is larger than ``MAX_ELEMENTS``, when it is not split-invariant even
in eval mode (measured here: then keyed dropout cannot make it so), or when its train forward
draws nothing (no dropout-like op: train equals eval without keyed).

Every architecture runs by default: the whole sweep takes about 25 s on 2 cores (``pytest
--durations``). ``KEYINIT_FULL_SWEEP=0`` runs only :data:`REPRESENTATIVE`, chosen for the ways
they lay the batch out; those may not be skipped. :data:`KNOWN_GAPS` would list the architectures keyed()
refuses, each with the reason (strict xfails: they fail loudly once they pass); there are none now: the
rows a router, a segment id or a shared index picks are followed on their values (``keyinit.nn._batch.routed``).
"""

from __future__ import annotations

import os
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import keyinit.nn as knn  # noqa: E402
from tests._support.drawn_keys import keys_drawn  # noqa: E402
from tests._support.hf_arch import lm_architectures, tiny_config  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

P = 0.1
#: Parameters and buffers of a tiny build, counted on the meta device (some default configs stay large).
MAX_ELEMENTS = 5_000_000
#: Logits are compared with this tolerance (float32 matmuls and attention over 1, 2 or 4 rows).
TOL = dict(rtol=1e-4, atol=1e-4)
#: The splits of the batch of 4 compared with it: halves (``sample_offset`` 0 and 2) and single rows (these
#: for :data:`REPRESENTATIVE` only: they double the sweep's time; tests/nn/sweeps/test_keyed_sweep_seq2seq_vision.py
#: runs them on every architecture).
SPLITS = (((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4)))

#: The CI selection, by how each lays out the batch where it draws:
REPRESENTATIVE = (
    "bert",  # (B, L, D) dropouts, (B, H, L, L) attention probabilities
    "gpt2",  # Conv1D projections (addmm on (B*L, D)), eager attention
    "llama",  # SDPA with dropout_p > 0, rotary embeddings
    "opt",  # dropout on (B*L, D) flattened rows; LayerDrop
    "xglm",  # LayerDrop, attention probabilities (B*H, L, S)
    "trocr",  # (B*H, L, S) attention (bmm), LayerDrop
    "mvp",  # BART-style decoder with LayerDrop
    "bart",  # LayerDrop: torch.rand([]) per layer, replicated
    "whisper",  # LayerDrop, the Whisper decoder
    "xlnet",  # sequence-first (L, B, D) activations, einsum attention
    "funnel",  # pooling along the sequence, new_ones masks, relative attention
    "deepseek_v3",  # MoE with multi-head latent attention: routed experts and a shared expert
    "jetmoe",  # MoE: x[batch_index] rows per expert, split/cat, zeros.index_add back (values checked)
    "nemotron_h",  # MoE: tokens sorted by expert, x[perm // k], _grouped_mm, y[inv_perm] back to a batch
    "tapas",  # segment reduce: scatter_reduce into (batch * segments) rows, positions checked on the values
    "prophetnet",  # gather by relative buckets that are every sample's (laid out as another merge)
)


#: Refused by keyed() (UnkeyedRandomnessError), and why (none now).
KNOWN_GAPS: dict = {}


def _selected() -> list:
    every = lm_architectures()
    if os.environ.get("KEYINIT_FULL_SWEEP") == "0":
        every = [(t, c) for t, c in every if t in REPRESENTATIVE]
    return [pytest.param(t, c, id=t, marks=pytest.mark.xfail(reason=KNOWN_GAPS[t], strict=True))
            if t in KNOWN_GAPS else pytest.param(t, c, id=t) for t, c in every]


SELECTED = _selected()


def test_the_selection_holds_every_representative():
    # the CI subset cannot shrink silently when transformers renames or drops an architecture
    types = {t for t, _ in lm_architectures()}
    assert set(REPRESENTATIVE) <= types, sorted(set(REPRESENTATIVE) - types)
    assert len(types) >= 150


def _skip(model_type: str, reason: str) -> None:
    if model_type in REPRESENTATIVE:  # the subset that says what keyed() holds on may not shrink
        pytest.fail(f"{model_type} is representative and may not be skipped: {reason}")
    pytest.skip(f"{model_type}: {reason}")


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out[0]


def _build(model_type: str, class_name: str) -> tuple[Any, torch.Tensor]:
    try:
        config = tiny_config(model_type, dropout=P)
        cls = getattr(transformers, class_name)
    except Exception as exc:  # noqa: BLE001 - the shrunk config is not valid for this architecture
        _skip(model_type, f"no tiny config ({type(exc).__name__})")
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                probe = cls(config)
        except Exception as exc:  # noqa: BLE001 - transformers' own failure on a tiny config
            _skip(model_type, f"the tiny config does not build ({type(exc).__name__})")
        elements = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
        del probe
        if elements > MAX_ELEMENTS:
            _skip(model_type, f"{elements} elements (at most {MAX_ELEMENTS} here)")
        torch.manual_seed(0)
        try:
            model = cls(config)
        except Exception as exc:  # noqa: BLE001
            _skip(model_type, f"the tiny config does not build eagerly ({type(exc).__name__})")
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 64)
    ids = (torch.arange(4 * 8).reshape(4, 8) * 7 + 3) % max(int(vocab) - 4, 2) + 4
    return model, ids


class _Taps:
    """Forward hooks: every dropout module's (mask, input non-zero) per call, and the modules run."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.masks: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.ran: list[str] = []
        self.handles = []
        for name, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            if "drop" in type(module).__name__.lower():
                self.handles.append(module.register_forward_hook(self._post(name)))

    def _pre(self, name: str):
        def hook(module, args):
            self.ran.append(name)
        return hook

    def _post(self, name: str):
        def hook(module, args, out):
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and x.shape == out.shape:
                calls = sum(1 for (n, _) in self.masks if n == name)
                self.masks[(name, calls)] = ((out == 0).detach().clone(), (x != 0).detach().clone())
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _joined(whole: torch.Tensor, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
    """``parts`` joined along the one dimension where their shape is not the whole's (the batch), or the
    parts themselves when they have the whole's shape (a tensor that holds no batch)."""
    if all(p.shape == whole.shape for p in parts):
        return parts
    dims = [d for d in range(whole.dim()) if parts[0].shape[d] != whole.shape[d]]
    assert len(dims) == 1 and sum(p.shape[dims[0]] for p in parts) == whole.shape[dims[0]], (
        what, tuple(whole.shape), [tuple(p.shape) for p in parts])
    return [torch.cat(parts, dims[0])]


def _rng_state() -> tuple:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _same_rng(a: tuple, b: tuple) -> bool:
    numpy_same = a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
    return torch.equal(a[0], b[0]) and numpy_same and a[2] == b[2]


def _routed(name: str) -> bool:
    """A module of a mixture of experts' experts (run only on the rows a router sends it)."""
    return ".experts." in name or ".expert_" in name


def _fixed(calls: Any) -> Any:
    """The modules (a list) or dropout calls (a dict) of a forward that are not an expert's."""
    if isinstance(calls, dict):
        return {k: v for k, v in calls.items() if not _routed(k[0])}.keys()
    return [name for name in calls if not _routed(name)]


def check_keyed_splits(model: Any, run: Any, splits: Any, eval_whole: torch.Tensor, label: str, differs: Any) -> None:
    """``run(None)`` (the whole batch) and ``run((lo, hi))`` (rows ``lo:hi``, ``sample_offset=lo``) under
    ``keyed``: each split's joined logits equal the whole batch's (with a tolerance), every dropout module's
    mask is the whole batch's bitwise, the same modules run, the draws are live (``differs`` from the eval
    logits), step 1 ``differs`` from step 0, and no global RNG is read or advanced."""
    before = _rng_state()
    taps = _Taps(model)
    try:
        with keys_drawn() as drawn, knn.keyed(model, 0, step=0):
            whole = run(None)
        (masks, ran), taps.masks, taps.ran = (dict(taps.masks), list(taps.ran)), {}, []
        results = []
        for split in splits:
            parts, part_taps = [], []
            for lo, hi in split:
                with knn.keyed(model, 0, step=0, sample_offset=lo):
                    parts.append(run((lo, hi)))
                part_taps.append((dict(taps.masks), list(taps.ran)))
                taps.masks, taps.ran = {}, []
            results.append((torch.cat(parts), part_taps))
        with knn.keyed(model, 0, step=1):
            step1 = run(None)
    finally:
        taps.remove()
    after = _rng_state()

    assert _same_rng(before, after), f"{label}: a keyed forward read or advanced a global RNG"
    keys = [(forward, k) for forward, _, k in drawn]  # a module run twice numbers its calls on (spec 14.4)
    shared = sorted({str(k) for forward, k in keys if keys.count((forward, k)) > 1})
    assert not shared, f"{label}: two draws of one forward share a key: {shared[:3]}"
    assert differs(whole, eval_whole), f"{label}: keyed draws are not live"
    assert differs(whole, step1), f"{label}: step 1 gives step 0's values"
    for split, (joined_logits, part_taps) in zip(splits, results):
        torch.testing.assert_close(joined_logits, whole, **TOL,
                                   msg=lambda m: f"{label}: split {split} changes logits: {m}")
        # A mixture of experts runs an expert only on the rows routed to it: a part whose rows no token of
        # sends there does not run it (nor draw its masks). Every other module runs in every part.
        for part_masks, part_ran in part_taps:
            assert _fixed(part_ran) == _fixed(ran), \
                f"{label}: split {split} ran other modules (a LayerDrop decision differs)"
            assert _fixed(part_masks) == _fixed(masks), f"{label}: dropout calls differ in split {split}"
            assert set(part_ran) <= set(ran) and part_masks.keys() <= masks.keys(), \
                f"{label}: split {split} ran an expert the whole batch did not"
        assert set().union(*(p[1] for p in part_taps)) == set(ran), f"{label}: split {split} skipped an expert"
        for call, (mask, nonzero) in masks.items():
            drawn = [p for p in part_taps if call in p[0]]  # (all of them, but for an expert: those routed to it)
            joined = _joined(mask, [p[0][call][0] for p in drawn], f"{label} {call}")
            live = _joined(nonzero, [p[0][call][1] for p in drawn], f"{label} {call}")
            for got, got_live in zip(joined, live):
                both = nonzero & got_live  # a zero input gives a zero output whatever the mask
                assert torch.equal(got & both, mask & both), f"{label}: the mask of {call} depends on the split"


@pytest.mark.parametrize("model_type,class_name", SELECTED)
def test_keyed_training_forward_is_split_invariant(model_type, class_name):
    model, ids = _build(model_type, class_name)
    halves = SPLITS[0]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.eval()
        try:
            eval_whole = _logits(model, ids)
            eval_parts = torch.cat([_logits(model, ids[lo:hi]) for lo, hi in halves])
        except Exception as exc:  # noqa: BLE001 - needs more than input_ids (images, audio, a cache, ...)
            _skip(model_type, f"does not run from input_ids ({type(exc).__name__}: {str(exc)[:80]})")
        if not torch.allclose(eval_whole, eval_parts, **TOL):
            _skip(model_type, "not split-invariant even in eval mode (max |diff| "
                  f"{(eval_whole - eval_parts).abs().max().item():.3g})")
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()  # running statistics: batch statistics mix the samples
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            if torch.equal(_logits(model, ids), eval_whole):
                _skip(model_type, "its train forward draws nothing (no dropout-like op)")

        splits = SPLITS if model_type in REPRESENTATIVE else SPLITS[:1]
        check_keyed_splits(model, lambda rows: _logits(model, ids if rows is None else ids[rows[0]:rows[1]]),
                           splits, eval_whole, model_type, differs=lambda a, b: not torch.allclose(a, b, **TOL))
