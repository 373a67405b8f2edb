"""Checkpoints loaded inside a deferred constructor (issue 23): safetensors files, read by
``safetensors.torch.load_file``, ``safe_open`` (what Hugging Face and timm use) or ``torch.asarray`` of a
storage, give the loaded values, as ``torch.load`` does: loaded tensors are constants of the record. Hugging
Face's ``from_pretrained`` loads them in a thread pool: deterministic work in threads a constructor starts
runs, a draw there is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import keyinit

safetensors_torch = pytest.importorskip("safetensors.torch")


def _source(dtype: torch.dtype) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)).to(dtype)


class Loads(nn.Module):
    def __init__(self, path: str, how: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)).to(dtype)
        self.head = nn.Linear(6, 2)
        if how == "load_file":
            state = safetensors_torch.load_file(path)
        else:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                state = {name: handle.get_tensor(name) for name in handle.keys()}
                state["0.weight"] = handle.get_slice("0.weight")[:, :]
        self.body.load_state_dict(state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["load_file", "safe_open"])
def test_a_safetensors_checkpoint_loaded_in_a_constructor_gives_its_values(tmp_path, how, dtype):
    source = _source(dtype)
    safetensors_torch.save_file(source.state_dict(), tmp_path / "body.safetensors")
    model = keyinit.deferred(Loads, str(tmp_path / "body.safetensors"), how, dtype)  # a raw ValueError before
    keyinit.materialize(model, 0, device="cpu")
    for name, value in source.state_dict().items():
        assert torch.equal(model.body.state_dict()[name], value), name
    reference = keyinit.deferred(Loads, str(tmp_path / "body.safetensors"), how, dtype)
    keyinit.materialize(reference, 0, device="cpu")
    assert torch.equal(model.head.weight, reference.head.weight)  # the rest is keyed as usual


def test_asarray_of_a_storage_in_a_constructor_is_the_storages_values():
    class FromMemory(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            raw = torch.UntypedStorage.from_buffer(torch.arange(6.0).numpy().tobytes(), dtype=torch.uint8)
            self.register_buffer("table", torch.asarray(raw, dtype=torch.uint8).view(torch.float32).reshape(2, 3))

    model = keyinit.deferred(FromMemory)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.table, torch.arange(6.0).reshape(2, 3))


def test_timm_pretrained_from_a_local_safetensors_file(tmp_path):
    timm = pytest.importorskip("timm")
    with torch.random.fork_rng(devices=[]):
        source = timm.create_model("resnet18", num_classes=10)
    safetensors_torch.save_file(source.state_dict(), tmp_path / "resnet18.safetensors")
    model = keyinit.deferred(timm.create_model, "resnet18", num_classes=10, pretrained=True,
                             pretrained_cfg_overlay={"file": str(tmp_path / "resnet18.safetensors"), "num_classes": 10})
    keyinit.materialize(model, 0, device="cpu")
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_hugging_face_from_pretrained_of_a_local_checkpoint_in_deferred(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64)
    with torch.random.fork_rng(devices=[]):
        source = transformers.LlamaForCausalLM(config)
    source.save_pretrained(tmp_path)  # safetensors, which HF loads in a thread pool
    model = keyinit.deferred(transformers.LlamaForCausalLM.from_pretrained, str(tmp_path))
    keyinit.materialize(model, 0, device="cpu")
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_deterministic_work_in_a_thread_the_constructor_starts_runs_and_a_draw_there_is_refused():
    from concurrent.futures import ThreadPoolExecutor

    class Threaded(nn.Module):
        def __init__(self, draw: bool) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            with ThreadPoolExecutor(2) as pool:
                tables = list(pool.map(lambda i: torch.rand(3) if draw else torch.arange(3.0) * i, range(2)))
            self.register_buffer("tables", torch.stack(tables))

    model = keyinit.deferred(Threaded, False)
    keyinit.materialize(model, 0, device="cpu")
    assert torch.equal(model.tables, torch.stack([torch.arange(3.0) * 0, torch.arange(3.0) * 1]))
    rng = torch.get_rng_state()
    with pytest.raises(keyinit.UnkeyedRandomnessError, match=r"ran torch ops \(aten\.rand\.default\) in a thread"):
        keyinit.deferred(Threaded, True)
    assert torch.equal(rng, torch.get_rng_state())
