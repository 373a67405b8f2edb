"""The random-op table (keyinit/_engine/programs/random_ops.py): one entry per random op, refusing a second,
each naming a real random aten op, and what the entries claim of torch's ops is true of torch's ops."""

from __future__ import annotations

import pytest
import torch

from keyinit._engine.programs.random_ops import (INPUT, RANDOM_OPS, RandomOp, is_random, random_op,
                                                 register_random_op)


def _overloads(name: str) -> list:
    packet = getattr(torch.ops.aten, name[len("aten::"):])
    return [getattr(packet, overload) for overload in packet.overloads()]


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_every_entry_names_a_random_aten_op(name):
    ops = _overloads(name)
    assert ops and all(is_random(op) for op in ops)


def test_an_op_registered_twice_is_refused():
    before = dict(RANDOM_OPS)
    entry = RANDOM_OPS["aten::uniform_"]
    with pytest.raises(ValueError, match=r"random op aten::uniform_ is already in the random-op table"):
        register_random_op(RandomOp("aten::uniform_", entry.keyed))
    with pytest.raises(ValueError, match=r"its aten name \('aten::uniform_'\), got 'uniform_'"):
        register_random_op(RandomOp("uniform_", entry.keyed))
    assert RANDOM_OPS == before


def test_every_random_op_whose_base_name_has_a_keyed_equivalent_has_its_own_entry():
    """An in-place draw, its functional form and its ``.out`` variant are different aten names; each has an
    entry (an op without one is unkeyable), so no form of a keyed op is refused by a missing name."""
    keyed_bases = {name[len("aten::"):].rstrip("_") for name in RANDOM_OPS}
    missing = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        base, _, overload = qualified[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if is_random(op) and base.rstrip("_") in keyed_bases and f"aten::{base}" not in RANDOM_OPS:
            missing.add(f"aten::{base}")
    assert missing == set()


def test_an_in_place_or_like_draw_has_its_input_s_batch():
    for name, entry in RANDOM_OPS.items():
        if name.endswith("_") or name.endswith("_like"):
            assert entry.batch == INPUT, name
    assert random_op("aten::poisson").keyed is None and random_op("aten::poisson").batch != INPUT
    assert random_op("aten::some_future_draw_").batch == INPUT


def _advances(fn) -> bool:
    state = torch.get_rng_state()
    try:
        fn()
        return not torch.equal(torch.get_rng_state(), state)
    finally:
        torch.set_rng_state(state)


def test_advances_at_p0_is_what_torch_s_kernels_do():
    """The ops the table says torch advances the generator for at p = 0 do advance it (keyinit answers them
    there); the flag is not set on an op with no p."""
    x = torch.ones(8)
    at_p0 = {
        "aten::bernoulli": lambda: torch.ops.aten.bernoulli.p(x, 0.0),
        "aten::bernoulli_": lambda: x.clone().bernoulli_(0.0),
        "aten::native_dropout": lambda: torch.ops.aten.native_dropout(x, 0.0, True),
    }
    flagged = {name for name, entry in RANDOM_OPS.items() if entry.advances_at_p0}
    assert flagged == set(at_p0)
    for name, call in at_p0.items():
        assert _advances(call), name
