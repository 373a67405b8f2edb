"""keyinit verify runs the real plan: zoo models under its default layouts, and costs that follow distinct shards.

``tests/zoo/test_zoo.py`` shows real gloo runs of the zoo (FSDP2 x4, FSDP2xTP 2x2) bit-identical to one
process; here ``verify`` reaches the same verdict in one process, for its default layouts (pipeline
stages of encoder-decoder models included), with no factory kwargs: the factory is built with
``keyinit.deferred``, so HF's own init (``post_init`` in the constructor) is what is replayed, and
fidelity finds every tensor following HF's eager init.
"""

from __future__ import annotations

import functools

import pytest
from torch import nn

import keyinit
from keyinit.cli.verify import DEFAULT_LAYOUTS, verify
from keyinit._engine.planning.planned import ModelPlan
from tests._support import hf_zoo as _zoo


@pytest.mark.parametrize("name", [*_zoo.NAMES])
def test_verify_default_layouts_on_the_zoo(name):
    # built on CPU: verify's deferred build captures it on stand-ins, and its eager build runs HF's init
    result = verify(functools.partial(_zoo.build, name, "cpu"), DEFAULT_LAYOUTS.split(","), seed=3,
                    progress=False, label=name)
    assert "plan_error" not in result, result.get("plan_error")
    assert result["layouts_ok"], [(p["fqn"], p["bad"]) for p in result["params"] if p["bad"]]
    fidelity = result["fidelity"]
    assert fidelity.skipped is None
    assert not fidelity.with_status("DIFFERS"), [(t.fqn, t.difference) for t in fidelity.with_status("DIFFERS")]
    assert not fidelity.with_status("not compared")
    assert result["ok"]
    assert {p["source"] for p in result["params"]} == {"constructor"}  # HF's init ran in the constructor


def test_verify_reports_clip_as_a_plan_error():
    result = verify(functools.partial(_zoo.build, "clip"), ["fsdp4"], progress=False)
    assert not result["ok"] and "logit_scale" in result["plan_error"]


def test_verify_catches_what_a_real_run_gets_wrong():
    """An initializer that ignores its region gives every shard the same values: verify says MISMATCH."""

    def first_rows(key, target):
        values = keyinit.random.normal(key, target.global_shape)
        target.out.copy_(values.reshape(-1)[: target.out.numel()].reshape(target.out.shape))

    def factory():
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), {"rules": {"0.weight": first_rows}}

    result = verify(factory, ["fsdp4"], progress=False)
    assert not result["ok"]
    bad = {p["fqn"]: p["bad"] for p in result["params"] if p["bad"]}
    assert bad == {"0.weight": {"fsdp4": [1, 2, 3]}}


def test_verify_cost_follows_distinct_shards_not_ranks(monkeypatch):
    from examples.models import tiny_llama

    calls = {"n": 0}
    original = ModelPlan.write

    def counting(self, tensor, target):
        calls["n"] += 1
        return original(self, tensor, target)

    monkeypatch.setattr(ModelPlan, "write", counting)
    tensors = len(verify(tiny_llama, ["1"], progress=False)["params"])
    calls["n"] = 0
    result = verify(tiny_llama, ["fsdp1024x8"], progress=False)  # 8192 ranks, 8 distinct shards per tensor
    assert result["ok"] and result["layouts"][0]["ranks"] == 8192
    assert calls["n"] <= tensors * (1 + 8)  # the reference, then at most 8 regions per tensor
    calls["n"] = 0
    result = verify(tiny_llama, ["fsdp100000"], progress=False)  # more ranks than any dim has rows
    assert result["ok"]
    largest = max(p["shape"][0] for p in result["params"] if p["shape"])
    assert calls["n"] <= tensors * (1 + largest + 1)


def test_a_layout_with_too_many_distinct_shards_is_a_clear_error():
    from keyinit.cli._common import CLIError

    def wide():
        return nn.Sequential(nn.Linear(4, 300000, bias=False))

    with pytest.raises(CLIError, match=r"distinct shards to check"):
        verify(wide, ["fsdp100000"], progress=False)


class Lopsided(nn.Module):
    """A vocabulary much larger than the block stack: any pipeline cut leaves nearly everything on stage 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


def test_verifys_final_line_says_when_a_pipeline_cut_tested_little(tmp_path, capsys):
    from keyinit.cli import main

    (tmp_path / "lopsided_models.py").write_text(
        "from tests.cli.test_verify import Lopsided\n\ndef build():\n    return Lopsided()\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["verify", "lopsided_models:build", "--layouts", "pp2,fsdp2", "--summary"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("lopsided_models", None)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and last.startswith("OK: bit-identical under every layout")
    assert "pp2 left 99% of the elements on one stage" in last, last  # it read as a full pass before


def test_verifys_failure_line_also_says_when_a_pipeline_cut_tested_little():
    from keyinit.cli.verify import _summary

    result = {"layouts_ok": False, "layouts": [
        {"layout": "pp2", "identical": 8, "total": 9, "unbalanced": "stage 0 holds ...", "stage_elements": [99, 1]},
        {"layout": "fsdp2", "identical": 9, "total": 9, "unbalanced": None, "stage_elements": [100]}]}
    assert _summary(result, None) == ("FAILED: bit-identical under 1 of 2 layouts (pp2 left 99% on one stage: little "
                                      "of the cut tested). Passed: fidelity not checked (--no-fidelity).")
