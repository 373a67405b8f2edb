"""The table of keyed()'s batching rules (keyinit/nn/_batch/rules.py): one rule per op, refused twice, and
every op it names a real ATen (or collective, or third-party) op overload packet that its lookup finds."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from keyinit.nn._batch import rules as _batch_rules
from keyinit.nn._batch.rules_tensor import pointwise

# op namespaces some of whose ops a Python module registers when imported: that module (the ops of a library
# that is not installed here cannot be looked up)
REGISTERED_BY = {"_c10d_functional": "torch.distributed._functional_collectives",
                 "transformers": "transformers.integrations.moe"}


def _first(func, args, kwargs, outs, records):
    return [None]


def _second(func, args, kwargs, outs, records):
    return [None]


def _named(rule) -> str:
    return f"{__name__}.{rule.__qualname__}"


def test_an_op_named_in_two_families_is_refused_naming_the_op_and_both_rules():
    expected = (f"batch rules: aten::view is given two rules, {_named(_first)} and {_named(_second)}; "
                "an op has one rule, in one family's RULES")
    with pytest.raises(ValueError) as raised:
        _batch_rules.build([(_first, ("aten::clone",)), (_first, ("aten::view",))], [(_second, ("aten::view",))])
    assert str(raised.value) == expected


def test_an_op_named_twice_in_one_family_is_refused_even_for_the_same_rule():
    with pytest.raises(ValueError, match=r"^batch rules: aten::view is given two rules, .*_first and .*_first;"):
        _batch_rules.build([(_first, ("aten::view", "aten::view"))])
    table: dict = {}
    _batch_rules.register(table, "aten::mm", _first)
    with pytest.raises(ValueError, match=r"^batch rules: aten::mm is given two rules"):
        _batch_rules.register(table, "aten::mm", _second)
    assert table == {"aten::mm": _first}


def test_the_families_build_one_table_without_a_refusal():
    from keyinit.nn._batch import rules_nn as _batch_rules_nn, rules_tensor as _batch_rules_tensor

    table = _batch_rules.build(_batch_rules_tensor.RULES, _batch_rules_nn.RULES)
    assert frozenset(table) == _batch_rules.names()
    assert len(table) == sum(len(names) for entries in (_batch_rules_tensor.RULES, _batch_rules_nn.RULES)
                             for _, names in entries)


def _packet(name: str):
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op, None)


def test_every_op_name_is_an_overload_packet_whose_overloads_find_its_rule():
    checked, missing, absent = 0, [], []
    for name in sorted(_batch_rules.names()):
        namespace = name.split("::")[0]
        if namespace in REGISTERED_BY:
            library = REGISTERED_BY[namespace]
            if importlib.util.find_spec(library.split(".")[0]) is None:
                absent.append(name)
                continue
            importlib.import_module(library)
        packet = _packet(name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            missing.append(name)
            continue
        assert packet._qualified_op_name == name
        rule = _batch_rules.rule_for(getattr(packet, packet.overloads()[0]))
        for overload in packet.overloads():
            assert _batch_rules.rule_for(getattr(packet, overload)) is rule, f"{name}.{overload}"
        checked += 1
    assert missing == []
    assert all(not name.startswith(("aten::", "_c10d_functional::")) for name in absent)
    assert checked + len(absent) == len(_batch_rules.names())


def test_an_op_without_an_entry_falls_back_to_the_pointwise_rule_only_when_tagged_pointwise():
    assert "aten::add" not in _batch_rules.names() and torch.Tag.pointwise in torch.ops.aten.add.Tensor.tags
    assert _batch_rules.rule_for(torch.ops.aten.add.Tensor) is pointwise
    assert _batch_rules.rule_for(torch.ops.aten.where.ScalarOther) is pointwise
    assert "aten::linalg_qr" not in _batch_rules.names()
    assert torch.Tag.pointwise not in torch.ops.aten.linalg_qr.default.tags
    assert _batch_rules.rule_for(torch.ops.aten.linalg_qr.default) is None
