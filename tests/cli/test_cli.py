"""The ``keyinit`` command line: demo, verify, slice, and its error handling."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import keyinit
from keyinit.cli import main
from keyinit.cli._layout_specs import parse_layout
from keyinit.cli.slicing import parse_selector

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.models import llama, llama_rules  # noqa: E402


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A throwaway module of factories, importable as ``usermodels``."""
    source = textwrap.dedent('''
        import torch
        from torch import nn
        import keyinit
        from keyinit import init

        class Custom(nn.Module):
            """Init code that reads its sibling's shape: run keyed by reset_parameters."""
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.empty(6, 5))
                self.bias = nn.Parameter(torch.empty(6))
                self.reset_parameters()
            def reset_parameters(self):
                nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
                bound = 1 / self.weight.shape[1] ** 0.5
                nn.init.uniform_(self.bias, -bound, bound)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(13, 4)
                self.custom = Custom()
                self.proj = nn.Linear(4, 7)

        def net():
            return Net()

        def local_shape_bug(key, target):
            # the classic bug: drawing the LOCAL shape instead of the region of the global shape
            target.out.copy_(keyinit.random.normal(key, tuple(target.out.shape)))

        def buggy():
            return Net(), {"rules": {"proj.weight": local_shape_bug}}

        class Uncovered(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)
                self.scale = nn.Parameter(torch.empty(3))

        def uncovered():
            return Uncovered()

        def raises():
            raise RuntimeError("boom in factory")

        def not_a_module():
            return 42
    ''')
    (tmp_path / "usermodels.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("usermodels", None)
    yield "usermodels"
    sys.modules.pop("usermodels", None)


# --------------------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_all_layouts_bit_identical_with_zero_collectives():
    proc = subprocess.run([sys.executable, "-m", "keyinit", "demo", "--world-size", "4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split("  ")[0]: line for line in proc.stdout.splitlines()}
    for label in ("FSDP2 (4)", "HSDP (2x2)", "TP (4)", "FSDP2xTP (2x2)", "PP (2 stages)"):
        line = rows[label]
        cells = [c for c in line[len(label):].split("  ") if c.strip()]
        assert cells[0].strip() == "21/21", line
        assert cells[1].strip() == "0", line  # collectives during init
    # the control: gathering DOES issue collectives, so the counter is live
    assert int([c for c in rows["FSDP2 (4)"][len("FSDP2 (4)"):].split("  ") if c.strip()][2]) > 0
    assert "predict the real local shards of" in proc.stdout
    assert "OK:" in proc.stdout


def test_demo_skips_layouts_the_world_size_cannot_hold(capsys):
    code, out, _ = run_cli(capsys, "demo", "--world-size", "3", "--layouts", "hsdp,fsdp_tp")
    assert code == 0
    assert out.count("skipped: needs an even world size >= 4") == 2


def test_demo_rejects_unknown_layout_and_size(capsys):
    code, _, err = run_cli(capsys, "demo", "--layouts", "fsdp,zero3")
    assert code == 2 and "unknown layouts ['zero3']" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "demo", "--model-size", "huge")
    assert code == 2 and "unknown --model-size" in err


# --------------------------------------------------------------------------- verify


def test_verify_llama_all_default_layouts(capsys):
    code, out, _ = run_cli(capsys, "verify", "examples.models:tiny_llama_with_rules")
    assert code == 0, out
    assert "OK:" in out
    for name in ("fsdp4", "tp2", "fsdp2xtp2", "pp2", "fsdp8x8"):
        assert f"{name} (" in out
    assert "21/21" in out and "DIFF" not in out


def test_verify_tied_embeddings_across_stages_and_convnet(capsys):
    code, out, _ = run_cli(capsys, "verify", "examples.models:tiny_llama_tied",
                           "--layouts", "pp2,pp2xfsdp2xtp2", "--summary")
    assert code == 0, out
    code, out, _ = run_cli(capsys, "verify", "examples.models:tiny_convnet", "--layouts", "fsdp3,tp2,hsdp2x2,pp2")
    assert code == 0, out
    assert "bn1.num_batches_tracked" in out


def test_verify_catches_an_initializer_that_ignores_the_region(capsys, user_module):
    code, out, _ = run_cli(capsys, "verify", f"{user_module}:buggy", "--layouts", "fsdp2,tp2,pp2")
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith("proj.weight"))
    assert "DIFF (ranks 1)" in line  # rank 0 of fsdp2 holds rows 0..3 and happens to agree in its first block
    assert line.split()[-1] == "ok"  # pp2: the stage holds the whole tensor, so the bug does not show
    assert "MISMATCH" in out


def test_verify_reports_uncovered_parameters(capsys, user_module):
    code, out, err = run_cli(capsys, "verify", f"{user_module}:uncovered")
    assert code == 1
    assert "scale" in err and "nothing was checked" in err


def test_verify_runs_init_code_for_modules_without_rules(capsys, user_module):
    code, out, _ = run_cli(capsys, "verify", f"{user_module}:net", "--layouts", "fsdp2,pp2")
    line = next(line for line in out.splitlines() if line.startswith("custom.bias"))
    assert "constructor" in line and code == 0, out  # built with keyinit.deferred: its constructor's record
    code, out, _ = run_cli(capsys, "verify", f"{user_module}:net", "--layouts", "fsdp2,pp2", "--build", "meta")
    line = next(line for line in out.splitlines() if line.startswith("custom.bias"))
    assert "reset_parameters" in line  # built on meta: reset_parameters captured while planning
    # custom.bias reads self.weight.shape[1], which FSDP's row shards keep: ok under fsdp2
    assert code == 0, out


def test_verify_file_path_factory(capsys, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from torch import nn\ndef f():\n    return nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))\n")
    code, out, _ = run_cli(capsys, "verify", f"{path}:f", "--layouts", "fsdp2,tp2,pp2")
    assert code == 0, out


def test_layout_grammar():
    assert parse_layout("fsdp8x8").mesh_kinds == ("replicate", "fsdp")
    assert parse_layout("fsdp8x8").world_size == 64
    assert parse_layout("pp2xfsdp2xtp2").world_size == 8
    assert parse_layout("hsdp2x4").mesh_shape == (2, 4)
    for bad in ("tp2xfsdp2", "hsdp2", "x", "fsdp2x", "zero3", "pp2xpp2"):
        with pytest.raises(keyinit.cli.CLIError):
            parse_layout(bad)


# --------------------------------------------------------------------------- slice


def reference_llama(seed: int = 0) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = llama("tiny")
    keyinit.materialize(model, seed, device="cpu", rules=llama_rules(model.args))
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("selector, index", [
    ("layers.1.feed_forward.w2.weight[0:3, 80:]", (slice(0, 3), slice(80, None))),
    ("output.weight[-1, ::7]", (-1, slice(None, None, 7))),
    ("tok_embeddings.weight[[0, 5, 96], 3]", ([0, 5, 96], 3)),
    ("layers.0.attention.wk.weight[..., 1]", (Ellipsis, 1)),
    ("norm.weight", None),
    ("layers.0.attention.wq.weight[5:1:-2]", ([5, 3],)),  # torch has no negative steps; the CLI does
])
def test_slice_equals_the_training_runs_values(capsys, tmp_path, selector, index):
    ref = reference_llama(seed=3)
    fqn = selector.split("[")[0]
    full = ref[fqn]
    if index is None:
        expected = full
    elif isinstance(index[0], list):
        expected = full[index[0]] if len(index) == 1 else full[index[0]][:, index[1]]
    else:
        expected = full[index]
    out = tmp_path / "s.pt"
    code, stdout, _ = run_cli(capsys, "slice", "examples.models:tiny_llama_with_rules", selector, "--seed", "3",
                              "--out", str(out))
    assert code == 0, stdout
    got = torch.load(out)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_slice_prints_and_saves_npy(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "slice", "examples.models:tiny_llama", "output.weight[0:2, 0:3]")
    assert code == 0
    assert "(2, 3) of output.weight (97x32, float32), seed 0" in out and "default Linear" in out and "sha256" in out
    path = tmp_path / "s.npy"
    code, _, _ = run_cli(capsys, "slice", "examples.models:tiny_llama", "output.weight[0:2, 0:3]", "--out", str(path))
    assert code == 0
    with torch.device("meta"):
        model = llama("tiny")
    keyinit.materialize(model, 0, device="cpu")
    assert np.array_equal(np.load(path), model.output.weight.detach()[0:2, 0:3].numpy())


def test_slice_of_tensor_written_by_init_code(capsys, tmp_path, user_module):
    import importlib

    mod = importlib.import_module(user_module)
    model = mod.net()
    keyinit.init_model(model, 5)
    path = tmp_path / "b.pt"
    code, out, _ = run_cli(capsys, "slice", f"{user_module}:net", "custom.bias[1:4]", "--seed", "5", "--out", str(path))
    assert code == 0
    assert "reset_parameters" in out
    assert torch.equal(torch.load(path), model.custom.bias.detach()[1:4])


def test_slice_of_an_8b_model_allocates_only_the_slice(capsys):
    code, out, _ = run_cli(capsys, "slice", "examples.models:llama3_8b",
                           "layers.31.feed_forward.w2.weight[4095, -4:]", "--seed", "7")
    assert code == 0  # a full fp32 model is 32 GB: this only works because nothing else is allocated
    assert "(4,) of layers.31.feed_forward.w2.weight (4096x14336, float32), seed 7" in out


def test_selector_parsing():
    assert parse_selector("a.b[0:4, :8]") == ("a.b", [slice(0, 4), slice(None, 8)])
    assert parse_selector("a.b[-1, ..., [1, 2]]") == ("a.b", [-1, Ellipsis, [1, 2]])
    assert parse_selector("a.b") == ("a.b", None)


# --------------------------------------------------------------------------- errors: one line, exit code 2


@pytest.mark.parametrize("argv, message", [
    (["verify", "no_such_module_xyz:f"], "cannot import 'no_such_module_xyz'"),
    (["verify", "examples.models"], "expected MODULE:FACTORY"),
    (["verify", "examples.models:nope"], "has no attribute 'nope'"),
    (["verify", "USER:raises"], "raises() raised RuntimeError: boom in factory"),
    (["verify", "USER:not_a_module"], "returned int; expected an nn.Module"),
    (["verify", "examples.models:tiny_llama", "--layouts", "fsdp2xq"], "bad layout 'fsdp2xq'"),
    (["slice", "examples.models:tiny_llama", "output.wieght[0]"], "did you mean output.weight"),
    (["slice", "examples.models:tiny_llama", "output.weight[0:2,"], "bad selector"),
    (["slice", "examples.models:tiny_llama", "output.weight[0.5]"], "expected integers"),
    (["slice", "examples.models:tiny_llama", "output.weight[0, 0, 0]"], "too many indices"),
    (["slice", "examples.models:tiny_llama", "output.weight[97]"], "out of bounds"),
    (["slice", "examples.models:tiny_llama", "output.weight", "--out", "x.txt"], "must end in .pt or .npy"),
    (["slice", "examples.models:tiny_llama", "output.weight", "--seed", "-1"], "seed must be an int"),
])
def test_errors_are_one_line_with_exit_code_2(capsys, user_module, argv, message):
    argv = [a.replace("USER", user_module) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert message in lines[0]
    assert "Traceback" not in err


def test_debug_shows_the_traceback(capsys, user_module):
    code, _, err = run_cli(capsys, "--debug", "verify", f"{user_module}:raises")
    assert code == 2
    assert "Traceback" in err and "boom in factory" in err


def test_console_entry_point_and_usage_errors():
    proc = subprocess.run([sys.executable, "-m", "keyinit", "slice"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "required" in proc.stderr


def test_demo_verdict_fails_on_a_different_value_or_a_collective():
    from keyinit.cli.demo import summarize

    reference = {"a": "d1", "b": "d2"}

    def rank(digests, init_comms=0):
        return {"fsdp": {"label": "FSDP2 (2)", "digests": digests, "init_comms": init_comms, "gather_comms": 2,
                         "seconds": 0.1, "predicted": 2, "dtensors": 2}}

    rows, ok, _, _ = summarize(reference, [rank({"a": "d1", "b": "d2"})] * 2, ["fsdp"], {}, 0.1)
    assert ok and rows[1][1] == "2/2"
    rows, ok, _, _ = summarize(reference, [rank({"a": "d1", "b": "d2"}), rank({"a": "d1", "b": "XX"})],
                               ["fsdp"], {}, 0.1)
    assert not ok and rows[1][1] == "1/2  MISMATCH"  # one rank disagrees on b
    rows, ok, _, _ = summarize(reference, [rank({"a": "d1", "b": "d2"}, init_comms=1)] * 2, ["fsdp"], {}, 0.1)
    assert not ok and rows[1][2] == "1"
    rows, ok, _, _ = summarize(reference, [rank({"a": "d1"})] * 2, ["fsdp"], {}, 0.1)
    assert not ok  # a parameter no rank holds
