"""One check: a keyed HF language model under dynamic right padding gives every sample's real tokens the same
logits and dropout masks whether the sample is run in the whole batch, in a part padded to its own longest, or
alone (a batch of one). Used by ``tests/nn/sweeps/test_keyed_padding_sweep.py`` (a representative subset) and
``benchmarks/sweep_padding.py`` (every causal-LM and masked-LM architecture).

:func:`check` builds the architecture from its tiny config (``tests/_support/hf_arch.py``, every dropout-like
probability :data:`P`), token sequences of real lengths :data:`LENGTHS` right-padded with an attention mask,
and returns an :class:`Outcome`:

* ``skipped`` with the reason when the architecture is not a subject: its tiny config does not build, it does
  not run from ``input_ids`` and ``attention_mask``, it does not honour its attention mask (in eval mode a
  sample's real-token logits change with the padding of its batch, beyond :data:`EVAL_NOISE`), or its train
  forward draws nothing;
* ``refused`` with keyinit's error when a keyed forward raises (UnkeyedRandomnessError and the like);
* ``differ`` when a part's real-token logits are not the whole batch's (``assert_close`` with :data:`TOL`) or a
  dropout kernel call's mask is not, bitwise, the whole batch's at the same elements;
* ``kept`` otherwise.

Masks are read at the one kernel seam, ``keyinit._draw.dispatch.dropout`` (every keyed dropout: modules,
``F.dropout``, attention dropout of SDPA and eager attention), per call key. A part's call is matched with the
whole batch's call of the same key and its elements aligned dimension by dimension (:func:`alignments`: a
dimension is unchanged, or the batch ``(B*k)``, or tokens ``(L*k)``, or batch and tokens merged); every
aligned element whose input is non-zero in both must have the same keep bit (under stream v2 a padded
element keeps its name too, so padding positions are compared as well). A call whose shape cannot be aligned
(an expert's routed rows) is counted, not compared: the logits still cover it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import warnings
from typing import Any, Iterator, Optional

import attrs
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Every dropout-like probability of the tiny configs.
P = 0.1
#: Real lengths of the 4 samples (right padding to the longest of each batch): distinct from the tiny
#: configs' other extents (hidden 16, heads 2, head_dim 8, intermediate 24, vocab 64), so a dimension's
#: extent says whether it holds tokens.
LENGTHS = (11, 6, 9, 3)
#: The parts compared with the whole batch: a split (padded to 11 and 9) and each sample alone.
SPLITS = (((0, 1), (2, 3)), ((0,), (1,), (2,), (3,)))
#: Real-token logits of a part against the whole batch's (torch's float32 matmuls are not batch-invariant).
TOL = dict(rtol=1e-5, atol=1e-5)
#: In eval mode, a larger change of real-token logits with the padding means the attention mask is not honoured
#: (to the tolerance the keyed forwards are held to: the honoured ones change by under 1e-6 here).
EVAL_NOISE = TOL["atol"]
#: Layers of the tiny builds: two, so that what one layer hands the next (a mixture of experts' output rows) is
#: checked too; an architecture whose 2-layer config does not build is built with the tiny config's one.
LAYERS = 2
_LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers")
#: Parameters and buffers of a tiny build, counted on the meta device (some default configs stay large).
MAX_ELEMENTS = 5_000_000


@attrs.define
class Outcome:
    """What :func:`check` found for one architecture under one stream."""

    kind: str  # "kept", "differ", "refused", "skipped"
    reason: str = ""
    compared: int = 0  # kernel calls of the parts compared bitwise with the whole batch's
    unaligned: int = 0  # kernel calls whose elements could not be aligned (counted, not compared)
    worst: float = 0.0  # the largest |difference| of real-token logits over the parts
    masks_differ: int = 0  # kernel calls of the parts whose mask is not the whole batch's
    logits_differ: int = 0  # parts whose real-token logits are not the whole batch's
    layers: int = 0  # the layers of the build checked (0: unknown)
    noise: float = 0.0  # the largest change of eval real-token logits with the padding


class Skip(Exception):
    """The architecture is not a subject of the check (the reason in the message)."""


def build(model_type: str, class_name: str, layers: int = LAYERS) -> tuple[Any, Any]:
    """``(model, config)``: the tiny build with ``layers`` layers (torch's RNG forked and seeded), else with
    the tiny config's one; or :class:`Skip`."""
    import transformers

    from tests._support.hf_arch import tiny_config

    try:
        config = tiny_config(model_type, dropout=P)
        cls = getattr(transformers, class_name)
    except Exception as exc:  # noqa: BLE001 - the shrunk config is not valid for this architecture
        raise Skip(f"no tiny config ({type(exc).__name__})") from None
    if layers != 1:
        deeper = copy.deepcopy(config)
        for inner in (deeper, getattr(deeper, "text_config", None)):
            for name in _LAYER_FIELDS:
                if isinstance(getattr(inner, name, None), int) and getattr(inner, name) == 1:
                    try:
                        setattr(inner, name, layers)
                    except Exception:  # noqa: BLE001 - a config that validates its fields
                        pass
        try:
            return _built(cls, deeper)
        except Skip:
            pass
    return _built(cls, config)


def _built(cls: Any, config: Any) -> tuple[Any, Any]:
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                probe = cls(config)
            elements = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
            del probe
        except Exception as exc:  # noqa: BLE001 - transformers' own failure on a tiny config
            raise Skip(f"the tiny config does not build ({type(exc).__name__})") from None
        if elements > MAX_ELEMENTS:
            raise Skip(f"{elements} elements (at most {MAX_ELEMENTS} here)")
        torch.manual_seed(0)
        try:
            model = cls(config)
        except Exception as exc:  # noqa: BLE001
            raise Skip(f"the tiny config does not build eagerly ({type(exc).__name__})") from None
    return model, config


def batch(config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)`` of the 4 samples, right-padded to the longest."""
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 64)
    longest = max(LENGTHS)
    ids = (torch.arange(4 * longest).reshape(4, longest) * 7 + 3) % max(int(vocab) - 4, 2) + 4
    mask = (torch.arange(longest)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    pad = getattr(config, "pad_token_id", None)
    return torch.where(mask.bool(), ids, pad if isinstance(pad, int) and 0 <= pad < int(vocab) else 0), mask


def rows(ids: torch.Tensor, mask: torch.Tensor, part: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples ``part`` as their own batch, padded to their own longest."""
    longest = max(LENGTHS[b] for b in part)
    return ids[list(part), :longest], mask[list(part), :longest]


def logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask)
    found = getattr(out, "logits", None)
    return (found if found is not None else out[0]).detach()


def real_diff(whole: torch.Tensor, part: torch.Tensor, samples: tuple[int, ...]) -> float:
    """The largest |difference| of real-token logits between the whole batch's and a part's."""
    return max((part[i, :LENGTHS[b]] - whole[b, :LENGTHS[b]]).abs().max().item() for i, b in enumerate(samples))


@contextlib.contextmanager
def kernel_calls() -> Iterator[dict]:
    """Every keyed dropout kernel call while open: ``{(k0, k1, threshold): (shape, dropped, live)}`` (the
    dropped and live boolean tensors in the input's shape; a key called twice keeps its first call)."""
    from keyinit._draw import dispatch

    seen: dict = {}
    original = dispatch.dropout

    def recording(x, geometry):
        out = original(x, geometry)
        live = x != 0
        seen.setdefault((geometry.k0, geometry.k1, geometry.threshold),
                        (tuple(x.shape), ((out == 0) & live).detach().cpu(), live.detach().cpu()))
        return out

    dispatch.dropout = recording
    try:
        yield seen
    finally:
        dispatch.dropout = original


def alignments(whole: tuple[int, ...], part: tuple[int, ...], samples: tuple[int, ...], longest: int,
               part_longest: int) -> list[tuple[list[int], ...]]:
    """Every way of placing a part's elements in the whole batch's tensor: per dimension, the whole's indices
    of the part's indices. A dimension keeps its extent, or holds the batch (``B*k``, the samples' rows), or
    tokens (``L*k``, the first ``part_longest``), or batch and tokens merged (``(B, L, k)`` or ``(L, B, k)``)."""
    if len(whole) != len(part):
        return []
    n = len(samples)
    per_dim: list[list[list[int]]] = []
    for w, p in zip(whole, part):
        found: list[list[int]] = []
        if w == p:
            found.append(list(range(w)))
        if w % 4 == 0 and p == n * (w // 4):
            k = w // 4
            found.append([b * k + i for b in samples for i in range(k)])
        if w % longest == 0 and p == part_longest * (w // longest):
            k = w // longest
            found.append([t * k + i for t in range(part_longest) for i in range(k)])
        if w % (4 * longest) == 0 and p == n * part_longest * (w // (4 * longest)):
            k = w // (4 * longest)
            found.append([(b * longest + t) * k + i for b in samples for t in range(part_longest) for i in range(k)])
            found.append([(t * 4 + b) * k + i for t in range(part_longest) for b in samples for i in range(k)])
        unique = []
        for f in found:
            if f not in unique:
                unique.append(f)
        if not unique:
            return []
        per_dim.append(unique)
    return [tuple(c) for c in itertools.product(*per_dim)][:16]


def same_masks(whole_call: tuple, part_call: tuple, samples: tuple[int, ...], longest: int,
               part_longest: int) -> Optional[bool]:
    """Whether a part's kernel call drops exactly the whole batch's call's elements where both inputs are
    non-zero (None: the shapes cannot be aligned). Several alignments (ambiguous extents): any one."""
    (wshape, wdrop, wlive), (pshape, pdrop, plive) = whole_call, part_call
    ways = alignments(wshape, pshape, samples, longest, part_longest)
    if not ways:
        return None
    for way in ways:
        index = torch.meshgrid(*[torch.tensor(i) for i in way], indexing="ij") if way else ()
        both = wlive[index] & plive
        if torch.equal(wdrop[index] & both, pdrop & both):
            return True
    return False


def check(model_type: str, class_name: str, stream: str, splits: Any = SPLITS) -> Outcome:
    """The whole batch, then each part of ``splits``, under ``keyed(model, 0, step=1, stream=stream)`` (a
    part's ``sample_offset`` its first sample: the parts are contiguous). Built with :data:`LAYERS` layers,
    else (the deeper config does not build or run) with one."""
    outcome = _check(model_type, class_name, stream, splits, LAYERS)
    if outcome.kind == "skipped" and outcome.layers != 1 and outcome.reason.startswith(_NOT_RUN):
        outcome = _check(model_type, class_name, stream, splits, 1)
    return outcome


_NOT_RUN = "does not run from input_ids and attention_mask"


def _check(model_type: str, class_name: str, stream: str, splits: Any, layers: int) -> Outcome:
    import keyinit.nn as knn

    try:
        model, config = build(model_type, class_name, layers)
    except Skip as exc:
        return Outcome("skipped", str(exc))
    layers = _layers(config)
    ids, mask = batch(config)
    longest = max(LENGTHS)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.eval()
        try:
            eval_whole = logits(model, ids, mask)
            noise = max(real_diff(eval_whole, logits(model, *rows(ids, mask, (b,))), (b,)) for b in range(4))
        except Exception as exc:  # noqa: BLE001 - needs more than input_ids and an attention mask
            return Outcome("skipped", f"{_NOT_RUN} ({type(exc).__name__}: {first_line(str(exc), 80)})",
                           layers=layers)
        if not math.isfinite(noise) or noise > EVAL_NOISE:
            return Outcome("skipped", "does not honour its attention mask (eval real-token logits change "
                           f"with the padding by {noise:.2g} > {EVAL_NOISE:g})", layers=layers, noise=noise)
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()  # running statistics: batch statistics mix the samples
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            try:
                if torch.equal(logits(model, ids, mask), eval_whole):
                    return Outcome("skipped", "its train forward draws nothing (no dropout-like op)", layers=layers)
            except Exception as exc:  # noqa: BLE001 - transformers' own train-mode failure
                return Outcome("skipped", f"its train forward fails without keyinit ({type(exc).__name__})",
                               layers=layers)
        outcome = Outcome("kept", layers=layers, noise=noise)
        try:
            with kernel_calls() as whole_calls, knn.keyed(model, 0, step=1, stream=stream):
                whole = logits(model, ids, mask)
            for split in splits:
                for part in split:
                    with kernel_calls() as part_calls, knn.keyed(model, 0, step=1, sample_offset=part[0],
                                                                 stream=stream):
                        got = logits(model, *rows(ids, mask, part))
                    _compare(outcome, whole, got, whole_calls, part_calls, part, longest)
        except Exception as exc:  # noqa: BLE001 - keyinit's refusal (or failure), reported with its reason
            return Outcome("refused", f"{type(exc).__name__}: {first_line(str(exc))}", layers=layers)
    return outcome


def _layers(config: Any) -> int:
    for inner in (config, getattr(config, "text_config", None)):
        for name in _LAYER_FIELDS:
            if isinstance(getattr(inner, name, None), int):
                return getattr(inner, name)
    return 0


def _compare(outcome: Outcome, whole: torch.Tensor, got: torch.Tensor, whole_calls: dict, part_calls: dict,
             part: tuple[int, ...], longest: int) -> None:
    part_longest = max(LENGTHS[b] for b in part)
    diff = real_diff(whole, got, part)
    outcome.worst = max(outcome.worst, diff)
    problems = []
    if not all(torch.allclose(got[i, :LENGTHS[b]], whole[b, :LENGTHS[b]], **TOL) for i, b in enumerate(part)):
        outcome.logits_differ += 1
        problems.append(f"real-token logits of samples {part} differ by {diff:.2g}")
    for key, call in part_calls.items():
        if key not in whole_calls:
            problems.append(f"samples {part}: a kernel call whose key the whole batch did not draw")
            continue
        same = same_masks(whole_calls[key], call, part, longest, part_longest)
        if same is None:
            outcome.unaligned += 1
        else:
            outcome.compared += 1
            if not same:
                outcome.masks_differ += 1
                problems.append(f"samples {part}: the dropout mask of a {tuple(call[0])} kernel call differs")
    if problems and outcome.kind == "kept":
        outcome.kind, outcome.reason = "differ", problems[0]


def first_line(message: str, limit: int = 160) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
