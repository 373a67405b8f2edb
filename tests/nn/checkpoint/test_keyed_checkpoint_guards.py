"""keyinit's guards on the checkpoints it knows (issue 35): how it tells that a checkpoint runs, without reading the
Python stack.

While a keyed block (or a recompute after it) has hooks on a model, the first execution of torch's checkpoint
(reentrant or not) and of megatron-core's checkpoints runs inside a guard that keyinit set; nothing is found by
file or function names, so the checkpointed function may be called anything, wrapped or aliased. The guards
are on only while a block is, the checkpoints they guard install none of keyinit's process-wide watch
(keyinit.nn._context.unhanded), and megatron's ``CheckpointWithoutOutput`` (which recomputes from a gradient hook) is
keyed as its first execution. The reference is the same keyed model without checkpointing, bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from tests.nn.checkpoint.test_keyed_checkpoint_unhanded import Block, _exact, _ours, _x


class _Torch(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block, self.reentrant = Block(), reentrant

    def forward(self, x):
        return torch_checkpoint.checkpoint(self.block, x, use_reentrant=self.reentrant)


def test_the_guards_are_on_only_while_a_block_is():
    forward = torch_checkpoint.CheckpointFunction.__dict__["forward"]
    generator = torch_checkpoint._checkpoint_without_reentrant_generator
    net = _Torch(True).train()
    with knn.keyed(net, 3, step=1):
        assert torch_checkpoint.CheckpointFunction.__dict__["forward"] is not forward
        assert torch_checkpoint._checkpoint_without_reentrant_generator is not generator
        loss = net(_x()).sum()
    assert torch_checkpoint.CheckpointFunction.__dict__["forward"] is forward
    assert torch_checkpoint._checkpoint_without_reentrant_generator is generator
    loss.backward()  # (its recompute puts the block's hooks and the guards back for its call only)
    assert torch_checkpoint.CheckpointFunction.__dict__["forward"] is forward
    assert torch_checkpoint._checkpoint_without_reentrant_generator is generator


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_checkpoints_keyinit_knows_install_no_global_hook(reentrant, inside):
    net, x = _Torch(reentrant).train(), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).sum()
        if inside:
            loss.backward()
    assert not _ours()
    if not inside:
        loss.backward()
    assert not _ours()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


class _Named(nn.Module):
    """A checkpointed function with a draw of its own, under any name and wrapper (once, a nested function named
    ``run`` in keyinit's file told keyinit that transformers' keyed checkpoint ran)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.lin, self.reentrant = nn.Linear(8, 8), reentrant

    def forward(self, x):
        def run(y):
            return F.dropout(self.lin(y), 0.3, True)

        return torch_checkpoint.checkpoint(functools.partial(run), x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_draw_in_a_checkpointed_function_is_refused_whatever_the_function_is_called(reentrant):
    net = _Named(reentrant).train()
    with pytest.raises(UnkeyedRandomnessError, match=r"the root module \(_Named\): dropout\(p=0.3\) inside "
                                                     r"torch.utils.checkpoint"):
        with knn.keyed(net, 3, step=1):
            net(_x())


def _megatron():
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    return random


class _WithoutOutput(nn.Module):
    """megatron-core's ``CheckpointWithoutOutput``: the output's memory is freed after the forward, and recomputed
    by a gradient hook of a later tensor."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.block, self.head = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)), nn.Linear(8, 8)
        self.checkpointed = checkpointed

    def forward(self, x):
        if not self.checkpointed:
            return self.head(self.block(x))
        checkpoint = _megatron().CheckpointWithoutOutput(fp8=None)
        checkpoint.fp8 = False  # (megatron reads fp8=None as on; FP8 needs Transformer Engine)
        h = checkpoint.checkpoint(self.block, x)
        out = self.head(h)
        checkpoint.discard_output_and_register_recompute(out)
        return out


@pytest.mark.parametrize("after", [False, True])
def test_megatrons_checkpoint_without_output_is_keyed(monkeypatch, after):
    random = _megatron()
    monkeypatch.setattr(random, "_get_all_rng_states", lambda: (None, None, None))  # (CUDA states: CPU-only here)
    monkeypatch.setattr(random, "_set_all_rng_states", lambda *states: None)
    grads = []
    for checkpointed in (False, True):
        net = _WithoutOutput(checkpointed)
        keyinit.init_model(net, 0)
        x = _x()
        with knn.keyed(net.train(), 3, step=1):
            loss = net(x).square().sum()
            if not after:
                loss.backward()
        if after:
            with knn.keyed(_WithoutOutput(False).train(), 9, step=2) as teacher:
                teacher.model(torch.ones(6, 8))
            loss.backward()
        grads.append([x.grad] + [p.grad for p in net.parameters()])
    _exact(grads[1], grads[0])
