"""Activation checkpointing under keyed() leaves nothing behind on the model (issue 34, item 2).

When a keyed block ends, the model is as it was: no hook of keyinit's on any module, no instance
attribute added or changed, so that ``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` (an EMA
copy) work, after the block and inside it (where a copy carries none of keyinit's hooks either).
The recomputes that checkpointing runs in a later ``backward()`` still get the first execution's
keys: what they need is held by the checkpoint's own objects (torch's and megatron's autograd
function contexts, torch's non-reentrant checkpoint frame, transformers' checkpointed function,
``keyinit.nn.checkpoint``'s region), not by the module, and another ``keyed()`` block entered before
that ``backward()`` (a teacher model, keyed noise, the same model's next micro-batch) changes none
of them. The reference everywhere is the same keyed run without checkpointing, bit for bit.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from tests.nn.checkpoint.test_keyed_checkpoint import Net

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _snapshot(model: nn.Module) -> list:
    """Every module's hooks, instance attributes (by identity) and class ``forward``."""
    found = []
    for name, module in model.named_modules(remove_duplicate=False):
        hooks = {d: list(getattr(module, d).items()) for d in _HOOK_DICTS}
        attrs = {k: id(v) for k, v in vars(module).items() if k not in _HOOK_DICTS}
        found.append((name, type(module), type(module).forward, hooks, attrs))
    return found


def _assert_clean_copy(model: nn.Module, before: list, picklable: bool = True) -> None:
    """``torch.save``, ``pickle`` and ``copy.deepcopy`` of ``model`` work, and each copy has the hooks and
    instance attributes the model had before the block (``before``: its :func:`_snapshot`), none of keyinit's.
    (``picklable=False``: a model with a closure of its own as a hook, transformers' under gradient
    checkpointing, which torch.save and pickle refuse with or without keyinit: deep-copied only.)"""
    copies = [copy.deepcopy(model)]
    if picklable:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        copies += [torch.load(buf, weights_only=False), pickle.loads(pickle.dumps(model))]
    for other in copies:
        got = _snapshot(other)
        assert len(got) == len(before)
        for (name, kind, forward, hooks, attrs), (name0, kind0, forward0, hooks0, attrs0) in zip(got, before):
            assert (name, kind, forward) == (name0, kind0, forward0)
            assert {d: [k for k, _ in v] for d, v in hooks.items()} == \
                {d: [k for k, _ in v] for d, v in hooks0.items()}, name
            assert attrs.keys() == attrs0.keys(), name
            module = other.get_submodule(name)
            for value in list(vars(module).values()) + [h for v in hooks.values() for _, h in v]:
                assert not type(value).__module__.startswith("keyinit"), (name, value)
                assert not (getattr(value, "__module__", None) or "").startswith("keyinit"), (name, value)


def _exact(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, 6 * 8).reshape(6, 8).requires_grad_()


def _net(reentrant) -> Net:
    net = Net(reentrant)
    keyinit.init_model(net, 0)
    return net.train()


def _expected() -> list:
    net, x = _net(None), _x()
    with knn.keyed(net, 3, step=1):
        net(x).square().sum().backward()
    return [x.grad] + [p.grad for p in net.parameters()]


LATER = ["none", "teacher", "teacher with backward inside", "same model", "same model with backward inside"]


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("later", LATER)
def test_torch_checkpoint_leaves_nothing_and_a_later_block_changes_no_key(reentrant, later):
    net, x = _net(reentrant), _x()
    teacher = _net(reentrant)
    before = _snapshot(net)
    rng = torch.get_rng_state()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
        _assert_clean_copy(net, before)  # inside the block too
    assert _snapshot(net) == before
    _assert_clean_copy(net, before)
    if later == "none":
        loss.backward()
    elif later.startswith("teacher"):
        with knn.keyed(teacher, 7, step=5):
            teacher(torch.ones(6, 8)).sum()
            if later.endswith("inside"):
                loss.backward()
        if not later.endswith("inside"):
            loss.backward()
    else:
        with knn.keyed(net, 3, step=2):
            other = net(torch.ones(6, 8, requires_grad=True)).sum()
            if later.endswith("inside"):
                loss.backward()
        if not later.endswith("inside"):
            loss.backward()
        del other
    assert torch.equal(rng, torch.get_rng_state())
    _exact([x.grad] + [p.grad for p in net.parameters()], _expected())
    assert _snapshot(net) == before


def _hf(model_type: str, class_name: str, reentrant):
    transformers = pytest.importorskip("transformers")
    from tests._support.hf_arch import tiny_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(tiny_config(model_type, dropout=0.2)).train()
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


_IDS = (torch.arange(32).reshape(4, 8) * 7 + 3) % 60 + 4


@pytest.mark.parametrize("model_type,class_name", [("bart", "BartForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
@pytest.mark.parametrize("reentrant", [True, False])
def test_transformers_gradient_checkpointing_leaves_nothing_and_a_later_block_changes_no_key(
        model_type, class_name, reentrant):
    expected_model = _hf(model_type, class_name, None)
    with knn.keyed(expected_model, 3, step=1):
        expected_model(input_ids=_IDS).logits.square().mean().backward()
    model = _hf(model_type, class_name, reentrant)
    before = _snapshot(model)
    with knn.keyed(model, 3, step=1):
        loss = model(input_ids=_IDS).logits.square().mean()
        _assert_clean_copy(model, before, picklable=False)
    assert _snapshot(model) == before
    _assert_clean_copy(model, before, picklable=False)
    teacher = _hf(model_type, class_name, None)
    with knn.keyed(teacher, 9, step=4), torch.no_grad():
        teacher(input_ids=_IDS)
    with knn.keyed(model, 3, step=2), torch.no_grad():  # the same model again (an eval-style forward)
        model(input_ids=_IDS)
    loss.backward()
    assert _snapshot(model) == before
    got = {n: p.grad for n, p in model.named_parameters()}
    for name, p in expected_model.named_parameters():
        assert (p.grad is None) == (got[name] is None) and (p.grad is None or torch.equal(got[name], p.grad)), name


def test_megatron_checkpoint_leaves_nothing_and_a_later_block_changes_no_key(monkeypatch):
    from tests.nn.checkpoint.test_keyed_checkpoint_functions import _MegatronStyle, _megatron_checkpoint

    checkpoint = _megatron_checkpoint(monkeypatch)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for with_checkpoint in (False, True):
        torch.manual_seed(0)
        model = _MegatronStyle(checkpoint if with_checkpoint else None, direct=False).train()
        before = _snapshot(model)
        with knn.keyed(model, 3, step=1):
            loss = model(x).pow(2).sum()
        assert _snapshot(model) == before
        _assert_clean_copy(model, before)
        with knn.keyed(model, 3, step=2):
            model(x)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    _exact(grads[1], grads[0])


@pytest.mark.parametrize("reentrant", [True, False])
def test_keyinit_checkpoint_region_after_a_later_block_keeps_its_keys(reentrant):
    from tests.nn.checkpoint.test_keyed_checkpoint_functions import Model

    grads = []
    for how in ("plain", "keyinit"):
        model = Model(how, "own draws", reentrant)
        keyinit.init_model(model, 0)
        x = torch.linspace(-1, 1, 6 * 16).reshape(6, 16).requires_grad_()
        before = _snapshot(model)
        with knn.keyed(model.train(), 3, step=1):
            loss = model(x).square().sum()
        assert _snapshot(model) == before
        with knn.keyed(model, 3, step=2):
            model(torch.ones(6, 16))
        loss.backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    _exact(grads[1], grads[0])


def test_nothing_is_kept_once_the_graph_is_gone():
    import gc
    import weakref

    net, x = _net(True), _x()
    block = knn.keyed(net, 3, step=1)
    with block:
        loss = net(x).square().sum()
    ref = weakref.ref(block)
    assert type(ref()).__name__ == "Keyed"
    del block, loss
    gc.collect()
    assert ref() is None  # the context (its forwards' records) lived in the graph, not on the model


class _OwnCheckpoint(torch.autograd.Function):
    """A checkpoint keyinit does not know (not torch's, transformers', megatron's or keyinit's): it recomputes
    ``fn`` in backward without handing the recompute to keyinit."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


class _OwnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3))

    def forward(self, x):
        return _OwnCheckpoint.apply(self.block, x)


def test_a_recompute_keyinit_was_not_handed_inside_a_later_block_is_refused_naming_it():
    net = _OwnNet().train()
    x = torch.ones(4, 8, requires_grad=True)
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    with pytest.raises(UnkeyedRandomnessError,
                       match=r"in backward inside keyed\(_OwnNet, seed=3, step=2, sample_offset=0\), which was "
                             r"entered after keyed\(_OwnNet, seed=3, step=1, sample_offset=0\) and before that "
                             r"block's backward\(\): .*did not hand the recompute to keyinit"):
        with knn.keyed(net, 3, step=2):
            loss.backward()
