"""A sweep over the architectures the installed transformers offers, not a hand-picked zoo.

For each architecture (``tests/_support/hf_arch.py``: one class per ``model_type`` of the auto mappings,
built from its default config shrunk to a tiny one, no hub), ``keyinit verify``'s engine builds it
with :func:`keyinit.deferred`, plans it exactly as ``materialize`` does, and checks

* fidelity: every tensor against two eager builds of the same factory (deterministic tensors bit
  for bit, random ones by distribution: ``keyinit/cli/_fidelity.py``);
* layouts: every distinct region an FSDP(4) and a TP(2) rank would hold, replayed on its own, is
  bit-identical to the single-process values.

An architecture whose tiny config does not build eagerly (a config that validates its shapes,
a missing optional dependency) is skipped with the reason: that is transformers', not keyinit's.

What runs (``KEYINIT_HF_SWEEP``): by default (CI) the architectures in shard 0 of 8 (by CRC-32 of
the model type, so the choice is stable) whose tiny build has at most 2 million elements (counted
on the meta device first); ``KEYINIT_HF_SWEEP=all`` runs every architecture up to 50 million
elements (hours on 2 cores: run it by hand, or by shards); ``KEYINIT_HF_SWEEP=3/8`` runs shard 3 of 8.
"""

from __future__ import annotations

import os
import warnings
import zlib

import pytest
import torch

pytest.importorskip("transformers")

from tests._support.hf_arch import architectures, tiny_factory  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: Default selection: shard 0 of this many, tiny builds of at most MAX_ELEMENTS elements.
SHARDS = 8
MAX_ELEMENTS = 2_000_000
#: With KEYINIT_HF_SWEEP set: the eager builds and the keyed values must fit in memory.
MAX_ELEMENTS_ALL = 50_000_000


def _selection() -> tuple[int, int, bool]:
    """``(shard, shards, size cap)`` from ``KEYINIT_HF_SWEEP``."""
    spec = os.environ.get("KEYINIT_HF_SWEEP", "")
    if spec == "all":
        return 0, 1, False
    if spec:
        shard, _, shards = spec.partition("/")
        return int(shard), int(shards), False
    return 0, SHARDS, True


def _selected() -> list[tuple[str, str]]:
    shard, shards, _ = _selection()
    return [(t, c) for t, c in architectures() if zlib.crc32(t.encode()) % shards == shard]


SELECTED = _selected()


def test_the_selection_is_not_empty():
    # The sweep must not pass by testing nothing: the installed transformers offers hundreds of
    # model types and a shard of 8 holds dozens of them.
    assert len(architectures()) >= 100
    assert len(SELECTED) >= len(architectures()) // (2 * _selection()[1])


@pytest.mark.parametrize("model_type,class_name", SELECTED, ids=[t for t, _ in SELECTED])
def test_architecture_is_faithful_and_layout_invariant(model_type, class_name):
    from keyinit.cli.verify import verify

    try:
        factory = tiny_factory(model_type, class_name)
    except ValueError as exc:
        pytest.skip(str(exc))
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):  # sized without memory: some default configs stay large
                probe = factory()
        except Exception as exc:  # noqa: BLE001 - transformers' own failure on a tiny config
            pytest.skip(f"{model_type}: the tiny config does not build ({type(exc).__name__})")
    elements = sum(t.numel() for t in [*probe.parameters(), *probe.buffers()])
    del probe
    limit = MAX_ELEMENTS if _selection()[2] else MAX_ELEMENTS_ALL
    if elements > limit:
        pytest.skip(f"{model_type}: {elements} elements (this run checks at most {limit})")
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            factory()
        except Exception as exc:  # noqa: BLE001 - builds on meta, not eagerly: transformers' own failure
            pytest.skip(f"{model_type}: the tiny config does not build eagerly ({type(exc).__name__})")
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = verify(factory, ["fsdp4", "tp2"], seed=3, progress=False, label=model_type)
    assert torch.equal(rng, torch.get_rng_state()), "keyinit read or advanced the global RNG"
    assert "plan_error" not in result, result.get("plan_error")
    bad = {p["fqn"]: p["bad"] for p in result["params"] if p["bad"]}
    assert not bad, f"{model_type}: regions differ from the single-process values: {bad}"
    assert not [s for s in result["layouts"] if s["missing"]], result["layouts"]
    fidelity = result["fidelity"]
    assert fidelity is not None and fidelity.skipped is None, fidelity
    differs = [(t.fqn, t.difference) for t in fidelity.with_status("DIFFERS")]
    assert not differs, f"{model_type}: differs from its own eager init: {differs}"
