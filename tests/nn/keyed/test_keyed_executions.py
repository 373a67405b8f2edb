"""A module run more than once in one forward numbers its calls on (docs/spec.md 14.4, ``calls="forward"``).

Before, the count restarted at each execution, so the two executions of a shared ``nn.Dropout`` (T5's
``encoder.dropout`` on the embeddings and on the final hidden states, the benchmark block's ``self.drop``)
drew the same mask: kept selectable as ``keyed(..., calls="execution")``. The promise is tested as a promise:
each execution's mask is the public key's, bit for bit; checkpointing recomputes and compiled forwards number
them as the eager forward does; a split does not change them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError
from keyinit.nn import dropout_key

P = 0.5


def _mask(seed: int, step: int, fqn: str, ordinal: int, shape: tuple, first_sample: int = 0) -> torch.Tensor:
    """The keep-mask of call ``ordinal`` of module ``fqn`` over rows ``first_sample..`` (dropout_rows of ones)."""
    from keyinit.nn.functional import dropout_rows

    k = dropout_key(seed, step=step, fqn=fqn, ordinal=ordinal)
    return dropout_rows(torch.ones(shape), P, k, first_sample) != 0


class Twice(nn.Module):
    """One dropout module run twice, and an F.dropout of its own between (ordinal 0 of the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        a = self.drop(x)
        b = F.dropout(self.lin(x), P, self.training)
        return a, b, self.drop(x)


def _ones(rows: int = 4) -> torch.Tensor:
    return torch.ones(rows, 8)


def test_a_module_run_twice_numbers_its_calls_on_and_each_mask_is_the_keys():
    with torch.random.fork_rng():
        model = Twice().train()
    with knn.keyed(model, 3, step=5, stream="v1"):
        a, _, c = model(_ones())
    assert torch.equal(a != 0, _mask(3, 5, "drop", 0, (4, 8)))  # the first execution: as before
    assert torch.equal(c != 0, _mask(3, 5, "drop", 1, (4, 8)))  # the second: the module's call 1
    assert not torch.equal(a != 0, c != 0)


def test_calls_execution_keeps_the_first_rule_where_executions_share_keys():
    with torch.random.fork_rng():
        model = Twice().train()
    with knn.keyed(model, 3, step=5, calls="execution", stream="v1"):
        a, _, c = model(_ones())
    assert torch.equal(a != 0, _mask(3, 5, "drop", 0, (4, 8)))
    assert torch.equal(a, c)
    with knn.keyed(model, 3, step=5, index="dim0", stream="v1"):  # stream v1's first rule, whole
        a0, _, c0 = model(_ones())
    assert torch.equal(a0, a) and torch.equal(c0, c)
    with pytest.raises(ValueError, match="calls must be one of"):
        knn.keyed(model, 3, step=5, calls="module", stream="v1")


def test_the_numbering_does_not_depend_on_the_split():
    with torch.random.fork_rng():
        model = Twice().train()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with knn.keyed(model, 1, step=2):
        whole = model(x)
    with knn.keyed(model, 1, step=2) as ctx:
        parts = []
        for start in (0, 2):
            with ctx.micro_batch(start):
                parts.append(model(x[start:start + 2]))
    for got, want in zip(zip(*parts), whole):
        assert torch.equal(torch.cat(got), want)


class Shared(nn.Module):
    """A block (linear, then dropout) applied twice, each application checkpointed or not."""

    def __init__(self, reentrant) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(P))
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x):
        for _ in range(2):
            if self.reentrant is None:
                x = self.block(x)
            else:
                x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_module_run_twice_recomputes_each_executions_keys(reentrant):
    def grads(mode):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Shared(mode).train()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
        with knn.keyed(model, 0, step=1):
            model(x).sum().backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    plain = grads(None)
    for got, want in zip(grads(reentrant), plain):
        assert torch.equal(got, want)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Shared(None).train()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with knn.keyed(model, 0, step=1, calls="execution"):
        shared_keys = model(x)
    with knn.keyed(model, 0, step=1):
        assert not torch.equal(model(x), shared_keys)


def test_a_checkpointed_module_run_twice_on_the_same_input_is_refused_not_guessed():
    class Same(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(P))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False) + checkpoint(self.block, x, use_reentrant=False)

    with torch.random.fork_rng():
        model = Same().train()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with knn.keyed(model, 0, step=0):
        out = model(x)
        with pytest.raises(UnkeyedRandomnessError, match="module 'block', which ran more than once"):
            out.sum().backward()


def test_a_compiled_forward_numbers_a_module_run_twice_as_the_eager_one():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.drop = nn.Dropout(P)

        def forward(self, x):
            x = self.drop(self.lin(x))
            torch._dynamo.graph_break()
            return self.drop(x) + self.drop(x)  # the module's calls 1 and 2, in the next graph

    with torch.random.fork_rng():
        model = Broken().train()
    compiled = knn.compile(model, backend="aot_eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for step in range(2):
        for calls in ("forward", "execution"):
            with knn.keyed(model, 0, step=step, sample_offset=1, calls=calls):
                eager = model(x)
            with knn.keyed(compiled, 0, step=step, sample_offset=1, calls=calls):
                assert torch.equal(compiled(x), eager)


def test_t5s_two_encoder_dropouts_draw_two_masks():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
                                   dropout_rate=P, decoder_start_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.T5EncoderModel(config).train()
    seen = []  # (kept, known): an element whose input is 0 says nothing of its mask
    model.encoder.dropout.register_forward_hook(lambda m, args, out: seen.append((out != 0, args[0] != 0)))
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    for calls in ("forward", "execution"):
        seen.clear()
        with knn.keyed(model, 0, step=0, calls=calls):
            model(input_ids=ids)
        assert len(seen) == 2  # the embeddings' and the final hidden states' dropout: one module
        (first, known_first), (second, known_second) = seen
        known = known_first & known_second
        assert known.sum() > 100
        assert torch.equal(first[known], second[known]) == (calls == "execution")
