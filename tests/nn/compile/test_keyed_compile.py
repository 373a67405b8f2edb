"""keyinit.nn.compile: a keyed forward under torch.compile draws what the eager keyed forward draws.

Most tests compile with ``backend="aot_eager"`` (dynamo + AOTAutograd, torch's eager kernels:
outputs and gradients are then bitwise the eager keyed run's); one compiles with inductor, whose
fused kernels round differently, so there only the masks are compared bitwise.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import keyinit.nn as knn
from keyinit.errors import UnkeyedRandomnessError


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*dropout2d.*")
        yield
    torch._dynamo.reset()


class Counting:
    """An inner backend that counts the graphs it compiles (then hands them to aot_eager)."""

    def __init__(self) -> None:
        from torch._dynamo import lookup_backend

        self.calls = 0
        self.inner = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.calls += 1
        return self.inner(gm, example_inputs)


class DropPath(nn.Module):  # timm's stochastic depth: one Bernoulli per sample
    def forward(self, x):
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(0.8)
        return x * keep / 0.8


class Block(nn.Module):
    """Every kind of draw keyed() keys: the dropout family on batch-first and flattened (B*L, D) rows,
    channel-wise and alpha dropout, SDPA and multi-head attention dropout, a per-sample DropPath
    mask, and random ATen ops (rand_like, randint, normal_)."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.drop_path = DropPath()

    def forward(self, x):
        b, t, d = x.shape
        y = self.drop(self.lin(x))
        y = F.dropout(y.reshape(b * t, d), 0.2, self.training).view(b, t, d)
        q = y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).transpose(1, 2).reshape(b, t, d)
        y = y + a + self.attn(y, y, y)[0]
        noise = torch.rand_like(y) * 0.01 + torch.empty_like(y).normal_() * 0.01
        shift = torch.randint(0, 3, (b, 1, 1)).to(y.dtype)
        return (self.drop_path(y) + noise + shift + F.dropout1d(y.transpose(1, 2), 0.2).transpose(1, 2)
                + F.alpha_dropout(y, 0.1, True))


class Model(nn.Module):
    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(depth)])
        self.out = nn.Dropout(0.1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _model(depth: int = 2) -> Model:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Model(depth).train()


@contextlib.contextmanager
def kernel_masks():
    """Every keyed dropout kernel call while open, eager or compiled (``keyinit._draw.dispatch.dropout`` is
    the one seam of every kernel family): ``{(key words, threshold, base, sizes, strides): mask bytes}``. A
    compiled forward's trace may run a call twice; the same key and placement give the same mask."""
    from keyinit._draw import dispatch

    seen: dict = {}
    original = dispatch.dropout

    def recording(x, geometry):
        out = original(x, geometry)
        name = (geometry.k0, geometry.k1, geometry.threshold, geometry.base, tuple(geometry.sizes),
                tuple(geometry.gstrides), tuple(None if i is None else tuple(i.tolist()) for i in geometry.indices))
        mask = ((out == 0) & (x != 0)).numpy().tobytes()
        assert seen.setdefault(name, mask) == mask, name
        return out

    dispatch.dropout = recording
    try:
        yield seen
    finally:
        dispatch.dropout = original


def _inputs() -> torch.Tensor:
    return torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(1))


def _step(keyed_model, params, step, offset, x):
    with knn.keyed(keyed_model, 0, step=step, sample_offset=offset):
        y = keyed_model(x)
    y.pow(2).sum().backward()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return y.detach(), grads


@pytest.mark.slow
def test_compiled_draws_equal_eager_for_every_step_and_offset_without_recompiling():
    model, x = _model(), _inputs()
    params = list(model.parameters())
    inner = Counting()
    compiled = knn.compile(model, backend=inner)
    torch_state, np_state, py_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    runs = [(0, 0, x), (1, 0, x), (2, 0, x), (3, 2, x[2:]), (4, 2, x[2:]), (5, 1, x[1:3])]
    before = counters["stats"]["unique_graphs"]
    for i, (step, offset, rows) in enumerate(runs):
        eager_out, eager_grads = _step(model, params, step, offset, rows)
        out, grads = _step(compiled, params, step, offset, rows)
        assert torch.equal(out, eager_out), (step, offset)
        assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads)), (step, offset)
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
    # one dynamo graph for every step and offset (the batch dimension is dynamic), one keyed trace per
    # batch size: steps, seeds and offsets are inputs of the compiled graph
    assert counters["stats"]["unique_graphs"] == graphs == before + 1
    assert inner.calls == 2  # batch sizes 4 and 2
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and random.getstate() == py_state


@pytest.mark.slow
def test_no_graph_break_added():
    model, x = _model(), _inputs()
    plain = Counting()
    torch.compile(model, backend=plain, fullgraph=True)(x)  # unkeyed: torch's own draws
    keyed_inner = Counting()
    compiled = knn.compile(model, backend=keyed_inner, fullgraph=True)
    with knn.keyed(compiled, 0, step=0):
        compiled(x)
    assert plain.calls == keyed_inner.calls == 1


@pytest.mark.slow
def test_inductor_masks_equal_eager():
    model, x = _model(depth=1), _inputs()
    params = list(model.parameters())
    compiled = knn.compile(model)  # inductor
    for step, offset, rows in [(0, 0, x), (1, 2, x[2:])]:
        eager_out, eager_grads = _step(model, params, step, offset, rows)
        out, grads = _step(compiled, params, step, offset, rows)
        assert torch.equal(out == 0, eager_out == 0)
        torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_compiled_blocks_inside_an_eager_keyed_model():
    model, x = _model(depth=3), _inputs()
    params = list(model.parameters())
    eager = [_step(model, params, s, o, rows) for s, o, rows in [(0, 0, x), (1, 2, x[2:])]]
    for i, layer in enumerate(model.layers):  # torchtitan's per-block compile
        model.layers[i] = knn.compile(layer, backend="aot_eager")
    assert [name for name, _ in model.named_parameters()][0] == "layers.0._orig_mod.lin.weight"
    compiled = [_step(model, params, s, o, rows) for s, o, rows in [(0, 0, x), (1, 2, x[2:])]]
    for (a, ga), (b, gb) in zip(eager, compiled):
        assert torch.equal(a, b)
        assert all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.slow
def test_micro_batches_and_repeats():
    model, x = _model(), _inputs()
    compiled = knn.compile(model, backend="aot_eager")

    def run(m):
        with knn.keyed(m, 0, step=3) as ctx:
            with ctx.micro_batch(0):
                first = m(x[:2])
            with ctx.micro_batch(2):
                second = m(x[2:])
            again = m(x)  # rows 0..3 again: a repeat, keyed differently
        return first.detach(), second.detach(), again.detach()

    for a, b in zip(run(model), run(compiled)):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_inside(reentrant):
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = _model().layers

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=reentrant)
            return x

    with torch.random.fork_rng():
        model = Checkpointed().train()
    params = list(model.parameters())
    x = _inputs().requires_grad_()
    eager = _step(model, params, 0, 0, x)
    compiled = _step(knn.compile(model, backend="aot_eager"), params, 0, 0, x)
    assert torch.equal(eager[0], compiled[0])
    assert all(torch.equal(a, b) for a, b in zip(eager[1], compiled[1]))


def test_a_module_whose_draws_run_eagerly_runs_as_an_eager_keyed_forward():
    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2)) for _ in range(3)])
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x):
            x = self.norm(x)  # running statistics: written once per call, also by the abandoned compiled try
            for layer in self.layers:
                if torch.rand([]) < 0.5:  # a graph break on a draw: dynamo runs this frame eagerly
                    continue
                x = layer(x)
            return x

    with torch.random.fork_rng():
        model = LayerDrop().train()
        twin = LayerDrop().train()
    twin.load_state_dict(model.state_dict())
    compiled = knn.compile(model, backend="aot_eager")
    state = torch.get_rng_state()
    for step in range(3):
        with knn.keyed(twin, 0, step=step, sample_offset=2):
            eager = twin(_inputs())
        if step == 0:
            with pytest.warns(UserWarning, match=r"runs part of its forward eagerly.*aten\.rand\.default"):
                with knn.keyed(compiled, 0, step=step, sample_offset=2):
                    out = compiled(_inputs())
        else:
            with knn.keyed(compiled, 0, step=step, sample_offset=2):
                out = compiled(_inputs())
        assert torch.equal(out, eager)
        assert torch.equal(model.norm.running_mean, twin.norm.running_mean)  # written once, not twice
        assert model.norm.num_batches_tracked == twin.norm.num_batches_tracked == step + 1
    assert torch.equal(torch.get_rng_state(), state)


def test_after_its_first_call_a_draw_that_runs_eagerly_is_refused():
    class Late(nn.Module):
        def forward(self, x):
            if x.shape[0] > 3:
                return F.dropout(x, 0.5, self.training)
            for _ in range(2):
                if torch.rand([]) < 0.5:  # only for small batches: dynamo runs this frame eagerly then
                    x = x + 1
            return x

    compiled = knn.compile(Late().train(), backend="aot_eager")
    with knn.keyed(compiled, 0, step=0):
        compiled(_inputs())  # a draw in a compiled graph: no more undo
    state = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError, match=r"aten\.rand\.default ran eagerly, outside the compiled graphs"):
        with knn.keyed(compiled, 0, step=0):
            compiled(_inputs()[:2])
    assert torch.equal(torch.get_rng_state(), state) and not compiled.runs_eagerly


def test_a_call_that_drew_nothing_compiled_leaves_the_fallback_open():
    class Late(nn.Module):
        def forward(self, x):
            if x.shape[0] > 3:
                return x * 2
            for _ in range(2):
                if torch.rand([]) < 0.5:
                    x = x + 1
            return x

    model = Late().train()
    compiled = knn.compile(model, backend="aot_eager")
    with knn.keyed(compiled, 0, step=0):
        compiled(_inputs())  # compiled, no draw
    with knn.keyed(model, 0, step=1):
        eager = model(_inputs()[:2])
    with pytest.warns(UserWarning, match="runs part of its forward eagerly"):
        with knn.keyed(compiled, 0, step=1):
            assert torch.equal(compiled(_inputs()[:2]), eager)
    assert compiled.runs_eagerly


def test_outside_keyed_a_draw_is_refused_and_eval_runs():
    with torch.random.fork_rng():
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).train()
    compiled = knn.compile(model, backend="aot_eager")
    state = torch.get_rng_state()
    with pytest.raises(UnkeyedRandomnessError, match=r"called outside keyinit.nn.keyed.*aten\.bernoulli"):
        compiled(_inputs())
    assert torch.equal(torch.get_rng_state(), state)
    model.eval()  # dropout draws nothing: compiled, outside keyed
    assert torch.equal(compiled(_inputs()), model(_inputs()))


def test_a_draw_inside_another_higher_order_op_runs_eagerly():
    class Noisy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x + torch.rand_like(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class M(nn.Module):
        def forward(self, x):
            return Noisy.apply(x)

    model = M().train()
    compiled = knn.compile(model, backend="aot_eager")
    with knn.keyed(model, 0, step=0):
        eager = model(_inputs().requires_grad_())
    with pytest.warns(UserWarning, match="inside torch.ops.higher_order"):
        with knn.keyed(compiled, 0, step=0):
            assert torch.equal(compiled(_inputs().requires_grad_()), eager)


@pytest.mark.slow
def test_hf_opt_and_timm_vit():
    transformers = pytest.importorskip("transformers")
    from tests._support.vision import import_vision

    timm = import_vision("timm")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        config = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        ffn_dim=32, dropout=0.1, attention_dropout=0.1, layerdrop=0.0,
                                        word_embed_proj_dim=16, max_position_embeddings=32)
        opt = transformers.OPTForCausalLM(config).train()  # dropout on (B*L, D) rows, (B*H, L, S) attention
        vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, drop_path_rate=0.2, drop_rate=0.1,
                                img_size=32, patch_size=8, depth=2).train()
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for model, x, run in ((opt, ids, lambda m, v: m(input_ids=v).logits), (vit, images, lambda m, v: m(v))):
        compiled = knn.compile(model, backend="aot_eager")
        for step, offset, rows in [(0, 0, x), (1, 2, x[2:])]:
            with knn.keyed(model, 0, step=step, sample_offset=offset):
                eager = run(model, rows)
            with knn.keyed(compiled, 0, step=step, sample_offset=offset):
                assert torch.equal(run(compiled, rows), eager)


def test_host_generators_as_in_the_eager_forward():
    class Host(nn.Module):
        def forward(self, x):
            return x * float(np.random.rand()) + random.random()

    model = Host().train()
    compiled = knn.compile(model, backend="aot_eager")
    np_state, py_state = np.random.get_state(), random.getstate()
    for step in range(2):
        for rows, host_random in ((slice(1, 2), "sample"), (slice(None), "forward"), (slice(None), "replicated")):
            with knn.keyed(model, 0, step=step, sample_offset=rows.start or 0, host_random=host_random):
                eager = model(_inputs()[rows])
            with knn.keyed(compiled, 0, step=step, sample_offset=rows.start or 0, host_random=host_random):
                assert torch.equal(compiled(_inputs()[rows]), eager), (step, host_random)
    for keyed_model in (model, compiled):  # a host draw over 4 samples without host_random=: refused in both
        with pytest.raises(UnkeyedRandomnessError, match="over samples 0..3"):
            with knn.keyed(keyed_model, 0, step=0):
                keyed_model(_inputs())
    assert np.array_equal(np.random.get_state()[1], np_state[1]) and random.getstate() == py_state


def test_plain_torch_compile_under_keyed_warns_and_runs_eagerly():
    with torch.random.fork_rng():
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).train()
    compiled = torch.compile(model, backend="aot_eager")
    with pytest.warns(UserWarning, match="use|compile it with keyinit.nn.compile"):
        with knn.keyed(compiled, 0, step=0):
            out = compiled(_inputs())
    with knn.keyed(model, 0, step=0):
        assert torch.equal(out, model(_inputs()))


def test_a_graph_break_in_the_compiled_forward_numbers_its_draws_on():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            x = F.dropout(self.lin(x), 0.3, self.training)  # call 0
            torch._dynamo.graph_break()
            return F.dropout(x, 0.3, self.training) + torch.rand_like(x)  # calls 1 and 2, in the next graph

    with torch.random.fork_rng():
        model = Broken().train()
    inner = Counting()
    compiled = knn.compile(model, backend=inner)
    for step in range(2):
        with knn.keyed(model, 0, step=step, sample_offset=1):
            eager = model(_inputs())
        with knn.keyed(compiled, 0, step=step, sample_offset=1):
            assert torch.equal(compiled(_inputs()), eager)
    assert inner.calls == 2  # two graphs, each compiled once


class _Picks(nn.Module):
    """Rows of the batch picked by index values: ``x[arange(B)[:, None], cols]`` (the rule checks that each
    sample picks its own rows), or a router's ``x[idx]`` written back by ``index_add``."""

    def __init__(self, routed: bool) -> None:
        super().__init__()
        self.routed = routed

    def forward(self, x):
        if self.routed:
            flat = x.reshape(-1, x.shape[-1])
            idx = flat[:, 0].argsort()
            y = F.dropout(flat[idx], 0.3, self.training)
            return torch.zeros(flat.shape).index_add(0, idx, y).view(x.shape) * 2
        rows = torch.arange(x.shape[0])[:, None]
        return F.dropout(x[rows, torch.tensor([2, 0, 1])], 0.3, self.training)


@pytest.mark.parametrize("routed", [False, True])
def test_a_graph_whose_batch_rules_read_index_values_runs_eagerly(routed):
    """A traced graph is replayed for any values, so where its batch goes may not rest on the values seen
    while tracing (keyinit.nn._batch.propagate.propagate_traced): that graph runs eagerly under keyed()'s modes, each
    call reading its own values, with the eager keyed forward's values."""
    model = _Picks(routed).train()
    compiled = knn.compile(model, backend="aot_eager")
    for step, offset, rows in [(0, 0, _inputs()), (1, 2, _inputs()[2:]), (2, 0, _inputs().flip(0))]:
        with knn.keyed(model, 0, step=step, sample_offset=offset):
            eager = model(rows)
        with knn.keyed(compiled, 0, step=step, sample_offset=offset), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert torch.equal(compiled(rows), eager)
        if step == 0:
            assert any("where its batch goes depends on values" in str(w.message) for w in seen), \
                [str(w.message) for w in seen]


#: HF causal LMs by how they lay out the batch where they draw. Every dropout-like probability is 0.1,
#: LayerDrop's too: OPT's `if torch.rand([]) < layerdrop` and BART's data-dependent branches make dynamo
#: run their decoders eagerly, so those run as eager keyed forwards (after a warning).
HF_COMPILED = ("bert", "gpt2", "llama", "opt", "xlnet", "bart",
               "nemotron_h")  # (a MoE whose compiled form sorts tokens by expert, transformers::grouped_mm_fallback)
HF_EAGER = ("opt", "bart")


@pytest.mark.parametrize("model_type", HF_COMPILED)
def test_hf_architectures_compiled_equal_eager(model_type):
    transformers = pytest.importorskip("transformers")
    from tests._support.hf_arch import lm_architectures, tiny_config

    class_name = dict(lm_architectures())[model_type]
    config = tiny_config(model_type, dropout=0.1)
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = getattr(transformers, class_name)(config).train()
    ids = (torch.arange(4 * 8).reshape(4, 8) * 7 + 3) % (config.vocab_size - 4) + 4

    def logits(m, x):
        out = m(input_ids=x)
        return out.logits if getattr(out, "logits", None) is not None else out[0]

    compiled = knn.compile(model, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, offset, rows in [(0, 0, ids), (1, 2, ids[2:])]:
            with knn.keyed(model, 0, step=step, sample_offset=offset), kernel_masks() as eager_masks:
                eager = logits(model, rows)
            with knn.keyed(compiled, 0, step=step, sample_offset=offset), kernel_masks() as compiled_masks:
                out = logits(compiled, rows)
            # keyinit's promise, bitwise: the same draws (keys, placements) with the same masks
            assert eager_masks and compiled_masks == eager_masks, model_type
            # torch's floating point (vectorised kernels, AOTAutograd's decompositions): within a tolerance
            # that a single differing mask would exceed by orders of magnitude
            torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert compiled.runs_eagerly == (model_type in HF_EAGER)


@pytest.mark.slow
def test_hf_gpt2_lm_with_its_cache_compiles_under_inductor_and_equals_eager():
    """GPT-2's LM head with labels and its default ``use_cache``: the cache's ``cat`` with an empty tensor
    has other strides under inductor's decompositions than on the real tensors the graph was traced on, so
    a view legal there failed inductor's trace (a ``ValueError`` at the first call)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
    ids = (torch.arange(2 * 12).reshape(2, 12) * 5 + 1) % 64
    compiled = knn.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with knn.keyed(model, 0, step=0), kernel_masks() as eager_masks:
            eager = model(input_ids=ids, labels=ids).loss
        with knn.keyed(compiled, 0, step=0), kernel_masks() as compiled_masks:
            out = compiled(input_ids=ids, labels=ids).loss
    assert not compiled.runs_eagerly
    assert eager_masks and compiled_masks == eager_masks
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
