"""Hostile and careless input, round 4 (issue 23): keyinit's own samplers inside a capture, failed calls
that would change the caller's objects, constructors that escape the capture."""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

import keyinit
import keyinit.data
from keyinit.errors import UnkeyedRandomnessError


# ---------------------------------------------------------------- keyinit's samplers inside a capture


class SampledInConstructor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(keyinit.random.normal(keyinit.key(0), (4, 4)))
        self.register_buffer("perm", keyinit.data.permutation(keyinit.key(3), 8))
        self.register_buffer("part", keyinit.data.permutation(keyinit.key(3), 8, torch.arange(2, 6)))


def test_keyinit_samplers_in_a_deferred_constructor_compute_their_values():
    model = keyinit.deferred(SampledInConstructor)  # the kernels wrote through a stand-in's null pointer: SIGSEGV
    keyinit.materialize(model, seed=1)
    assert torch.equal(model.w, keyinit.random.normal(keyinit.key(0), (4, 4)))
    assert torch.equal(model.perm, keyinit.data.permutation(keyinit.key(3), 8))
    assert torch.equal(model.part, keyinit.data.permutation(keyinit.key(3), 8)[2:6])


def test_a_keyinit_sampler_in_an_init_method_computes_its_values():
    def init_method(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(keyinit.random.uniform(keyinit.key(5), (3, 4)))

    model = nn.Sequential(nn.Linear(4, 3))
    keyinit.init_model(model, seed=1, init_method=init_method)
    assert torch.equal(model[0].weight, keyinit.random.uniform(keyinit.key(5), (3, 4)))


# ---------------------------------------------------------------- failed calls leave the caller's objects as they were


class Wrapper(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(4, 2)
        self.noise = torch.randn(3)  # a draw in a plain attribute: no key reaches it


def test_a_failed_deferred_leaves_the_pretrained_backbone_it_was_given_as_it_was():
    backbone = nn.Linear(4, 4)
    tensors = dict(backbone.named_parameters())
    values = {k: v.detach().clone() for k, v in tensors.items()}
    with pytest.raises(UnkeyedRandomnessError, match="noise"):
        keyinit.deferred(Wrapper, backbone)
    assert dict(backbone.named_parameters()) == tensors  # the same objects, still real
    for name, tensor in backbone.named_parameters():
        assert tensor.device.type == "cpu" and torch.equal(tensor, values[name]), name


def test_a_refused_sampler_state_leaves_the_sampler_where_it_was():
    from keyinit.data import KeyedSampler

    sampler = KeyedSampler(10, 0, global_batch_size=2)
    iterator = iter(sampler)
    next(iterator), next(iterator), next(iterator)  # one step done, an iteration in progress
    before = sampler.state_dict()
    state = {**before, "step": 4, "stop": 2}  # stop < step
    with pytest.raises(ValueError, match="stop"):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == before and sampler.step == before["step"]


def test_an_initializer_of_the_users_own_that_fails_after_writing_half_is_put_back():
    class Half(keyinit.init.Initializer):
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, key, target):
            self.calls += 1  # the plan-time dry run passes; the real write fails part-way
            target.out[: target.out.shape[0] // 2].fill_(7.0)
            if self.calls > 1:
                raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(4, 4))
    before = model[0].weight.detach().clone()
    with pytest.raises(keyinit.InitError, match="boom") as raised:
        keyinit.init_model(model, 0, rules={"0.weight": Half()})
    assert raised.value.written == ("0.bias",) and "partly" not in str(raised.value)
    assert torch.equal(model[0].weight, before)


# ---------------------------------------------------------------- what a capture cannot see: global generators, threads


class NumpyShuffle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("perm", torch.from_numpy(np.random.permutation(4)))


class PythonScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((4,), random.random()))


class Threaded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with ThreadPoolExecutor(2) as pool:
            self.layers = nn.ModuleList(pool.map(lambda _: nn.Linear(4, 4), range(3)))


@pytest.mark.parametrize("cls, match", [
    (NumpyShuffle, r"NumpyShuffle\(\.\.\.\): init code drew from the global generator of numpy\.random"),
    (PythonScale, r"PythonScale\(\.\.\.\): init code drew from the global generator of Python's random"),
    (Threaded, r"Threaded\(\.\.\.\): init code ran torch ops \(aten\.\w+.*\) in a thread it started"),
])
def test_global_generators_and_threads_in_a_constructor_are_refused_with_every_rng_untouched(cls, match):
    states = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state())
    with pytest.raises(UnkeyedRandomnessError, match=match):
        keyinit.deferred(cls)
    assert np.array_equal(np.random.get_state()[1], states[0]) and random.getstate() == states[1]
    assert torch.equal(torch.get_rng_state(), states[2])


def test_a_thread_started_in_a_capture_works_as_usual_once_the_capture_ended():
    pool = ThreadPoolExecutor(1)
    try:
        class Starts(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(2, 2)
                pool.submit(lambda: None).result()  # the pool's thread starts here, and outlives the capture

        keyinit.deferred(Starts)
        assert torch.equal(pool.submit(lambda: torch.ones(2) * 2).result(), torch.full((2,), 2.0))
    finally:
        pool.shutdown()


# ---------------------------------------------------------------- tensors sharing memory


class SharedRows(nn.Module):
    def __init__(self, overlap: bool) -> None:
        super().__init__()
        flat = torch.zeros(18)
        self.a = nn.Parameter(flat[:12].view(4, 3))
        self.b = nn.Parameter(flat[:6] if overlap else flat[12:])  # an LSTM's flattened weights share no element


def test_different_tensors_sharing_elements_are_a_plan_error_naming_both_before_any_write():
    model = SharedRows(overlap=True)
    rules = {"a": keyinit.init.normal(std=0.02), "b": keyinit.init.zeros()}
    with pytest.raises(keyinit.PlanError, match=r"^a and b are different tensors sharing memory") as raised:
        keyinit.init_model(model, 0, rules=rules)
    assert raised.value.fqns == ("a", "b") and not model.a.any()
    apart = SharedRows(overlap=False)  # views of one buffer that share no element are written as usual
    keyinit.init_model(apart, 0, rules=rules)
    separate = nn.Module()
    separate.a, separate.b = nn.Parameter(torch.empty(4, 3)), nn.Parameter(torch.empty(6))
    keyinit.init_model(separate, 0, rules=rules)
    assert torch.equal(apart.a, separate.a) and torch.equal(apart.b, separate.b)


# ---------------------------------------------------------------- materialize keeps what is not on meta


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)


def test_materialize_keeps_tensors_loaded_with_assign_and_says_so():
    model = keyinit.deferred(TwoLayers)
    loaded = {"a.weight": torch.ones(4, 4), "a.bias": torch.full((4,), 2.0)}
    model.load_state_dict(loaded, strict=False, assign=True)
    report = keyinit.materialize(model, seed=0, device="cpu")
    assert torch.equal(model.a.weight, loaded["a.weight"]) and torch.equal(model.a.bias, loaded["a.bias"])
    reference = keyinit.deferred(TwoLayers)
    keyinit.materialize(reference, seed=0, device="cpu")
    assert torch.equal(model.b.weight, reference.b.weight) and torch.equal(model.b.bias, reference.b.bias)
    assert {r.fqn: r.source for r in report.records}["a.weight"] == "kept"
    assert any(note.startswith("kept 2 tensors that were not on the meta device") and "a.weight, a.bias" in note
               for note in report.notes)


def test_materialize_with_nothing_on_meta_is_a_plan_error_and_writes_nothing():
    model = keyinit.deferred(TwoLayers)
    keyinit.materialize(model, seed=0, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(keyinit.PlanError, match=r"^materialize: no parameter or buffer of the model is on the meta"):
        keyinit.materialize(model, seed=1, device="cpu")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- a renumbered ModuleList


class DepthBlock(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        nn.init.normal_(self.fc.weight, std=0.02 / (depth + 1) ** 0.5)  # depth-scaled, as GPT-2's residual proj


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DepthBlock(i) for i in range(4))


def test_a_stage_cut_from_a_renumbered_module_list_gets_the_full_models_values_for_the_layers_it_holds():
    full = keyinit.deferred(Stack)
    keyinit.materialize(full, seed=0, device="cpu")
    stage = keyinit.deferred(Stack)
    del stage.layers[0]  # torch renumbers layers 1..3 as 0..2
    report = keyinit.materialize(stage, seed=0, device="cpu")
    for i in range(3):
        assert torch.equal(stage.layers[i].fc.weight, full.layers[i + 1].fc.weight), i
        assert torch.equal(stage.layers[i].fc.bias, full.layers[i + 1].fc.bias), i
    assert any("layers.0.fc.weight as layers.1.fc.weight" in note for note in report.notes)


# ---------------------------------------------------------------- stand-ins kept outside the model, hooks


@functools.lru_cache
def _rope_table(n: int) -> torch.Tensor:
    return torch.outer(torch.arange(n, dtype=torch.float32), torch.ones(2))


@functools.lru_cache
def _base_and_view(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(n, dtype=torch.float32)
    return base, base[1:]  # the view holds its base: swapped first


@functools.lru_cache
def _noise(n: int) -> torch.Tensor:
    return torch.randn(n)


def _scale(scale: torch.Tensor, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * scale


class KeepsTensorsOutside(nn.Module):
    table = None

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.rope = _rope_table(5)
        _base_and_view(4)
        type(self).table = torch.ones(3) * 3  # a class attribute cache
        self.register_forward_hook(functools.partial(_scale, torch.full((3,), 2.0)))
        mask = torch.tensor([[0.0], [1.0], [1.0]])  # frozen first row
        self.lin.weight.register_hook(lambda g: g * mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + type(self).table + self.rope[1, 0]


def test_tensors_a_constructor_keeps_outside_the_model_get_real_values_and_its_hooks_survive():
    model = keyinit.deferred(KeepsTensorsOutside)  # the stand-ins escaped: CaptureError at the first forward
    keyinit.materialize(model, seed=0, device="cpu")
    x = torch.ones(1, 2)
    out = model(x)
    assert torch.equal(out, (model.lin(x) + 3.0 + 1.0) * 2.0)
    assert torch.equal(_rope_table(5), torch.outer(torch.arange(5.0), torch.ones(2)))  # an eager caller later
    base, view = _base_and_view(4)
    assert torch.equal(base, torch.arange(4.0)) and torch.equal(view, torch.arange(1.0, 4.0))
    out.sum().backward()
    assert not model.lin.weight.grad[0].any() and model.lin.weight.grad[1:].all()  # the gradient hook kept


def test_a_draw_kept_in_an_lru_cache_is_an_error_naming_it_and_the_cache_is_cleared():
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            _noise(2)

    _noise.cache_clear()
    with pytest.raises(UnkeyedRandomnessError, match=r"Noisy\(\.\.\.\): code stored a tensor of shape \(2,\) "
                                                      r"computed from random draws .* in a functools\._lru_cache"):
        keyinit.deferred(Noisy)
    assert _noise.cache_info().currsize == 0 and type(_noise(2)) is torch.Tensor


# ---------------------------------------------------------------- torch.jit.script submodules


class ScriptedAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


class WithScripted(nn.Module):
    def __init__(self, scripted_linear: bool = False) -> None:
        super().__init__()
        self.lin = torch.jit.script(nn.Linear(4, 4)) if scripted_linear else nn.Linear(4, 4)
        self.act = torch.jit.script(ScriptedAct())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def test_a_scripted_submodule_without_tensors_is_initialized_around_and_one_with_tensors_is_a_plan_error():
    eager = WithScripted()
    keyinit.init_model(eager, 0)  # died in guard.py: TypeError: contains(): incompatible function arguments
    built = keyinit.deferred(WithScripted)
    keyinit.materialize(built, 0, device="cpu")
    assert built(torch.ones(1, 4)).shape == (1, 4)
    model = WithScripted(scripted_linear=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(keyinit.PlanError, match=r"^these tensors belong to a torch\.jit\.script module.*lin\.weight"):
        keyinit.init_model(model, 0, rules={"lin.*": keyinit.init.zeros()})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- torch.load in a constructor


def test_torch_load_in_a_deferred_constructor_gives_the_loaded_values(tmp_path):
    source = nn.Linear(4, 4)
    torch.save(source.state_dict(), tmp_path / "backbone.pt")

    class Pretrained(nn.Module):  # timm's create_model(pretrained=True) from a local file
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Linear(4, 4)
            self.head = nn.Linear(4, 2)
            self.backbone.load_state_dict(torch.load(tmp_path / "backbone.pt"))

    model = keyinit.deferred(Pretrained)  # a raw RuntimeError from torch's set_ on a stand-in
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.backbone.weight, source.weight) and torch.equal(model.backbone.bias, source.bias)
    reference = keyinit.deferred(Pretrained)
    keyinit.materialize(reference, 0, device="cpu")
    assert torch.equal(model.head.weight, reference.head.weight)


# ---------------------------------------------------------------- torch's hook-based weight_norm, spectral_norm, pruning


class HookNormed(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        if kind == "weight_norm":
            nn.utils.weight_norm(self.lin)
        elif kind == "spectral_norm":
            nn.utils.spectral_norm(self.lin)
        else:
            torch.nn.utils.prune.random_unstructured(self.lin, "weight", amount=0.5)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "prune"])
def test_torchs_hook_based_weight_utilities_in_a_constructor_work_as_in_eager_torch(kind):
    model = keyinit.deferred(HookNormed, kind)  # was refused: "register it as a buffer"
    keyinit.materialize(model, 0, device="cpu")
    lin = model.lin
    if kind == "weight_norm":
        expected = lin.weight_g * lin.weight_v / lin.weight_v.norm(dim=1, keepdim=True)
    elif kind == "spectral_norm":
        sigma = torch.dot(lin.weight_u, lin.weight_orig @ lin.weight_v)
        expected = lin.weight_orig / sigma
    else:
        expected = lin.weight_orig * lin.weight_mask
        assert int((lin.weight_mask == 0).sum()) == 6
    assert lin.weight.device.type == "cpu"
    torch.testing.assert_close(lin.weight, expected)
    x = torch.ones(2, 4)
    model.eval()  # spectral_norm's hook runs a power iteration at a training forward, as in eager torch
    torch.testing.assert_close(model.lin(x), x @ expected.T + lin.bias)
    again = keyinit.deferred(HookNormed, kind)
    keyinit.materialize(again, 0, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


# ---------------------------------------------------------------- modules added after deferred (resize_token_embeddings)


class OwnInit(nn.Module):
    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 4)
        self.head = nn.Linear(4, vocab, bias=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def resize(self, vocab: int) -> "OwnInit":  # as HF's resize_token_embeddings: new modules, its init
        with torch.device(self.emb.weight.device):
            self.emb, self.head = nn.Embedding(vocab, 4), nn.Linear(4, vocab, bias=False)
        self._init_weights(self.emb), self._init_weights(self.head)
        return self


def test_modules_added_after_deferred_that_would_get_torch_defaults_instead_of_the_models_init_are_a_plan_error():
    model = keyinit.deferred(OwnInit)
    model.resize(12)  # on meta: its own init computes nothing, torch.nn's N(0, 1) would fill the embedding
    with pytest.raises(keyinit.PlanError, match=r"^these tensors were added or replaced after keyinit\.deferred "
                                                r".*OwnInit\._init_weights.*: emb\.weight, head\.weight\. Make"):
        keyinit.materialize(model, 0, device="cpu")
    assert model.emb.weight.device.type == "meta"
    inside = keyinit.deferred(lambda: OwnInit().resize(12))  # done inside the builder: recorded
    keyinit.materialize(inside, 0, device="cpu")
    assert 0.01 < float(inside.emb.weight.std()) < 0.03


# ---------------------------------------------------------------- verify: pipeline cuts at the block stack, summary


class _GPTBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 24)
        self.mlp = nn.Linear(8, 32)


class TinyGPT(nn.Module):  # nanoGPT's layout: the block stack sits inside a ModuleDict of other parts
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(16, 8), wpe=nn.Embedding(8, 8),
                                              h=nn.ModuleList(_GPTBlock() for _ in range(4)), ln_f=nn.LayerNorm(8)))
        self.lm_head = nn.Linear(8, 16, bias=False)


class TinyViT(nn.Module):  # timm's layout: the blocks are an nn.Sequential
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(12, 8)
        self.blocks = nn.Sequential(*(_GPTBlock() for _ in range(4)))
        self.head = nn.Linear(8, 3)


@pytest.mark.parametrize("cls, pp, stack", [(TinyGPT, 4, "transformer.h."), (TinyViT, 2, "blocks.")])
def test_verify_cuts_pipeline_stages_at_the_block_stack_and_prints_each_stages_elements(cls, pp, stack, capsys):
    from keyinit.cli.verify import verify

    result = verify(cls, [f"pp{pp}"], progress=False, fidelity=False)
    [summary] = result["layouts"]
    blocks = sum(p.numel() for n, p in cls().named_parameters() if n.startswith(stack))
    per_block = blocks // 4
    assert summary["unbalanced"] is None and len(summary["stage_elements"]) == pp
    assert all(n >= per_block for n in summary["stage_elements"])  # every stage holds blocks
    assert max(summary["stage_elements"]) < 0.6 * sum(summary["stage_elements"])


def test_verify_flags_a_cut_that_leaves_everything_on_one_stage_and_says_what_failed_in_one_line(capsys):
    from keyinit.cli.verify import _summary, _unbalanced

    assert _unbalanced([199_936, 2_000, 3_000, 3_320]) == "stage 0 holds 199,936 of 208,256 elements (96%)"
    assert _unbalanced([100, 100]) is None
    result = {"layouts_ok": True, "layouts": [{"identical": 3, "total": 3}] * 2}

    class Fidelity:
        skipped = None
        tensors = [object()] * 5

        @staticmethod
        def with_status(status):
            return [object()] * {"DIFFERS": 2, "not compared": 0}.get(status, 0)

    assert _summary(result, Fidelity) == ("FAILED: fidelity: 2 tensors differ from the model's own eager init. "
                                          "Passed: bit-identical under every layout (2); fidelity: 3 tensors follow it.")


def test_hf_resize_token_embeddings_after_deferred_is_a_plan_error_and_inside_the_builder_gets_hfs_init():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = keyinit.deferred(LlamaForCausalLM, config)
    model.resize_token_embeddings(80, mean_resizing=False)  # on meta: HF's _init_weights computes nothing
    with pytest.raises(keyinit.PlanError, match=r"model\.embed_tokens\.weight, lm_head\.weight"):
        keyinit.materialize(model, 0, device="cpu")  # gave the embedding torch.nn's N(0, 1)

    def resized() -> nn.Module:
        built = LlamaForCausalLM(config)
        built.resize_token_embeddings(80, mean_resizing=False)
        return built

    inside = keyinit.deferred(resized)
    keyinit.materialize(inside, 0, device="cpu")
    for weight in (inside.model.embed_tokens.weight, inside.lm_head.weight):  # HF's initializer_range 0.02
        assert weight.shape[0] == 80 and 0.015 < float(weight.std()) < 0.025
