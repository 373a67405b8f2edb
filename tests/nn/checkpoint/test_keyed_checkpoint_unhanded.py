"""Checkpoints that do not hand their recompute to keyinit (issue 34): DeepSpeed's activation checkpointing, or a
hand-written reentrant ``autograd.Function`` that saves its inputs and reruns the module's forward in backward.

keyinit knows torch's, transformers' and megatron's checkpoints and its own; this one it sees only as a module
run with autograd off inside a forward that had it on. Its recompute in a ``backward()`` after the keyed
block (and after another keyed block) must draw the first execution's masks, or be refused with an error
that names the module and says how to checkpoint instead: never torch's generator, silently. The reference
is the same keyed model without checkpointing, bit for bit.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.modules.module as torch_module
from torch import nn

import keyinit
import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


class ReentrantCheckpoint(torch.autograd.Function):
    """DeepSpeed's ``CheckpointFunction`` in brief: run ``function`` without autograd, save the inputs, and in
    backward rerun it on detached copies of them (the same memory) with autograd on."""

    @staticmethod
    def forward(ctx, function, *args):
        ctx.function = function
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.function(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        torch.autograd.backward(outputs, grads)
        return (None,) + tuple(t.grad for t in inputs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return torch.nn.functional.dropout(self.drop(self.lin(x)).tanh(), 0.2, self.training) + x


class Net(nn.Module):
    """Three residual blocks; ``how``: "plain", or "module" (each block under the hand-written checkpoint), or
    "function" (a function that computes before it calls the block: its recompute cannot be matched)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.how = how

    def forward(self, x):
        for block in self.blocks:
            if self.how == "plain":
                x = block(x)
            elif self.how == "module":
                x = ReentrantCheckpoint.apply(block, x)
            else:
                x = ReentrantCheckpoint.apply(lambda y, block=block: block(y * 2), x)
        return self.norm(x)


def _net(how: str) -> Net:
    net = Net(how)
    keyinit.init_model(net, 0)
    return net.train()


def _x() -> torch.Tensor:
    return torch.linspace(-1, 1, 6 * 8).reshape(6, 8).requires_grad_()


def _grads(net: Net, x: torch.Tensor) -> list:
    return [x.grad] + [p.grad for p in net.parameters()]


def _exact(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def _ours() -> list:
    """keyinit's process-wide module hooks (keyinit.nn._context.unhanded) now set."""
    hooks = [*torch_module._global_forward_pre_hooks.values(), *torch_module._global_forward_hooks.values()]
    return [h for h in hooks if getattr(h, "__module__", "").startswith("keyinit")]


def _expected(step: int = 1) -> list:
    net, x = _net("plain"), _x()
    with knn.keyed(net, 3, step=step):
        net(x).square().sum().backward()
    return _grads(net, x)


LATER = ["none", "teacher", "teacher, backward inside", "same model", "same model, eval"]


@pytest.mark.parametrize("later", LATER)
def test_a_hand_written_reentrant_checkpoint_is_recomputed_with_the_first_executions_masks(later):
    net, x = _net("module"), _x()
    teacher = _net("plain")
    rng = torch.get_rng_state()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    assert all(not m._forward_pre_hooks and not m._forward_hooks and "forward" not in vars(m) for m in net.modules())
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
            if later.endswith("eval"):
                with torch.no_grad():
                    net(torch.ones(6, 8))
            else:
                other = net(torch.ones(6, 8, requires_grad=True)).sum()
        loss.backward()
    assert torch.equal(rng, torch.get_rng_state())  # never torch's generator
    _exact(_grads(net, x), _expected())
    other = _grads(net, x)
    assert not torch.equal(other[0], _expected(step=2)[0])  # the keys matter


def test_backward_inside_the_block_is_keyed_too():
    net, x = _net("module"), _x()
    with knn.keyed(net, 3, step=1):
        net(x).square().sum().backward()
    _exact(_grads(net, x), _expected())


def test_a_recompute_it_cannot_match_is_refused_naming_the_module_and_the_fix():
    """The checkpointed function computes (``y * 2``) before it calls the block: the recompute's inputs are new
    tensors, so keyinit cannot tell which execution it repeats. Before: torch's dropout, silently."""
    net, x = _net("function"), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    with pytest.raises(UnkeyedRandomnessError,
                       match=r"module 'blocks.2.drop' \(Dropout\): dropout\(p=0.3\) in backward, after its keyed "
                             r"block: a checkpoint that did not hand its recompute to keyinit .*DeepSpeed.* "
                             r"Checkpoint the module with torch.utils.checkpoint \(checkpoint\(module, x\)\) or the "
                             r"function with keyinit.nn.checkpoint"):
        loss.backward()


def test_a_recompute_that_repeats_executions_of_two_blocks_is_refused_naming_them():
    """Two blocks ran the model on the same input tensor, both graphs alive: the recompute could repeat either."""
    net, x = _net("module"), _x()
    with knn.keyed(net, 3, step=1):
        first = net(x).square().sum()
    with knn.keyed(net, 3, step=2):
        second = net(x).square().sum()
    with pytest.raises(UnkeyedRandomnessError,
                       match=r"module 'blocks.0.drop' \(Dropout\): dropout\(p=0.3\) in backward, after its keyed "
                             r"block: .* several blocks ran it on \(keyed\(Net, seed=3, step=1, sample_offset=0\), "
                             r"keyed\(Net, seed=3, step=2, sample_offset=0\)\)"):
        (first + second).backward()


def test_nothing_is_left_once_the_graph_is_gone():
    net, x = _net("module"), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    assert _ours()  # watching for the recompute while the graph lives
    loss.backward()
    del loss
    gc.collect()
    nn.Identity()(torch.ones(1))  # (the hooks take themselves off at the next module call)
    assert not _ours()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_a_forward_without_checkpointing_installs_no_global_hook():
    net, x = _net("plain"), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    assert not _ours()  # (only a block whose modules ran without autograd inside its forward is watched)
    loss.backward()


class _Frozen(nn.Module):
    """A frozen submodule run under torch.no_grad() inside the forward (a target encoder): nothing recomputes it."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.frozen = Block(), Block()

    def forward(self, x):
        with torch.no_grad():
            target = self.frozen(x)
        return (self.block(x) - target).square()


def test_a_module_run_under_no_grad_inside_the_forward_installs_no_global_hook():
    net, x = _Frozen().train(), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).sum()
    assert not _ours()
    loss.backward()


def test_a_compiled_forward_while_watching_stays_compiled():
    """dynamo traces module calls through torch's global hooks: the watch's hooks must not break its graph (a
    graph break makes keyinit.nn.compile run the model eagerly from then on)."""
    import warnings

    torch._dynamo.reset()  # (what earlier tests compiled, or failed to, is not this test's: as the compile tests do)
    net, x = _net("module"), _x()
    with knn.keyed(net, 3, step=1):
        loss = net(x).square().sum()
    assert _ours()
    other = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.Linear(8, 8)).train()
    keyinit.init_model(other, 0)
    compiled = knn.compile(other, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with knn.keyed(compiled, 5, step=0):
            compiled(torch.ones(4, 8, requires_grad=True)).sum().backward()
    assert not [w for w in caught if "runs eagerly" in str(w.message)], "\n".join(str(w.message) for w in caught if "runs eagerly" in str(w.message))
    loss.backward()
    _exact(_grads(net, x), _expected())
