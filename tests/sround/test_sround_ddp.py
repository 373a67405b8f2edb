"""Keyed stochastic rounding under DDP: a bf16/fp16 model trained with ``stochastic_rounding`` AdamW (the float32
path and ``fused=True``) inside ``DistributedDataParallel`` on 2 gloo ranks, from gradients equal to one
process's (every rank runs the same batch: the average of equal gradients is exact), has bitwise one process's
parameters on every rank; the names come from the DDP wrapper (``module.`` stripped)."""

from __future__ import annotations

import torch

import keyinit
from keyinit.optim import stochastic_rounding
from tests._support.dist import requires_gloo, run_distributed
from tests.sround.test_sround_optim import SEED, _model

STEPS = 3
FUSED = (False, True)


def _batch(t):
    return keyinit.random.randint(keyinit.fold_in(keyinit.key(8), t), (4, 3), low=0, high=7)


class Net(torch.nn.Module):
    """The layout tests' Tiny (bf16 embedding and head, fp16 projection, float32 norm) with a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.tiny = _model()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tiny = self.tiny
        hidden = tiny.embed(tokens).float().mean(1)
        out = tiny.head(tiny.proj(hidden.to(torch.float16)).to(torch.bfloat16))
        return tiny.norm(out.float()).pow(2).mean()


def _train(model, fused):
    """STEPS steps; ``model`` is a Net or a DDP of one (whose FQNs, wrapper stripped, are the Net's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    stochastic_rounding(opt, SEED, names=model, fused=fused)
    for t in range(STEPS):
        model(_batch(t)).backward()  # under DDP its hooks average the (equal) gradients
        opt.step()
        opt.zero_grad()
    net = getattr(model, "module", model)
    return {fqn: p.detach().clone() for fqn, p in net.named_parameters()}


def _single():
    return {fused: _train(Net(), fused) for fused in FUSED}


def _ddp_ranks():
    from torch.nn.parallel import DistributedDataParallel

    return {fused: _train(DistributedDataParallel(Net()), fused) for fused in FUSED}


@requires_gloo
def test_ddp_two_ranks_match_one_process_bitwise():
    # one process, also a fresh one: the same thread count and global torch settings as the ranks (this test's
    # pytest process may have other ones; an embedding's backward sums repeated tokens in a thread-dependent order)
    (single,) = run_distributed(_single, 1, timeout=240)
    start = dict(Net().named_parameters())
    for fused in FUSED:  # every low-precision parameter stepped
        for fqn in ("tiny.embed.weight", "tiny.proj.weight", "tiny.head.weight"):
            assert not torch.equal(single[fused][fqn], start[fqn]), fqn
    for rank, result in enumerate(run_distributed(_ddp_ranks, 2, timeout=240)):
        for fused in FUSED:
            assert result[fused].keys() == single[fused].keys()
            for fqn, want in single[fused].items():
                got = result[fused][fqn]
                assert got.dtype == want.dtype and torch.equal(got, want), f"rank {rank}, fused={fused}: {fqn}"
