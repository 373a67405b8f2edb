"""keyinit verify's fidelity check: keyed values against the model's own eager construction.

A small ResNet-like model initializes itself in its constructor as torchvision's ResNet does
(``kaiming_normal_(mode="fan_out")`` over its convs, BatchNorm constants, zero-init of each
block's last BatchNorm). Built with ``keyinit.deferred`` (what verify does), its keyed values
follow that init; built on meta without it (``--build meta``), the constructor's init is lost
and torch.nn defaults take its place, which fidelity names tensor by tensor.

Everything here is deterministic (keyed values for seed 0, eager builds under
``torch.manual_seed(1)``/``(2)`` inside ``fork_rng``); the statistics tests draw from private
generators.
"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from keyinit.cli import main
from keyinit.cli._common import CLIError
from keyinit.cli._fidelity import (
    ALPHA,
    MIN_ELEMENTS,
    compare,
    distribution_difference,
    ks_critical,
    ks_statistic,
)
from keyinit.cli.verify import verify

OK_LINE = "OK: bit-identical under every layout, and every tensor follows the model's own eager init"

SOURCE = textwrap.dedent('''
    import torch
    from torch import nn
    import keyinit
    from keyinit import init

    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    class ResNetLike(nn.Module):
        """torchvision's ResNet init, in its constructor."""
        def __init__(self, width=32, classes=10):
            super().__init__()
            self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(width)
            self.blocks = nn.Sequential(Block(width), Block(width))
            self.fc = nn.Linear(width, classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.constant_(m.weight, 1)
                    nn.init.constant_(m.bias, 0)
            for m in self.modules():  # zero_init_residual=True
                if isinstance(m, Block):
                    nn.init.constant_(m.bn2.weight, 0)

    def resnet():
        return ResNetLike()

    def resnet_on_meta():
        with torch.device("meta"):
            return ResNetLike()

    def resnet_with_rules():
        # a wider conv1 and BatchNorm scale 2 in every block: the user's choice, not the model's init
        return ResNetLike(), {"rules": {"blocks.*.conv1.weight": init.normal(std=0.5),
                                        "blocks.*.bn1.weight": init.constant(2.0)}}

    def resnet_deferred():
        return keyinit.deferred(ResNetLike)

    def exits():
        raise SystemExit(0)

    class Seeded(nn.Module):
        """A draw from the model's own seeded generator: the same values in every eager build, but
        keyinit keys every draw (docs/init-code.md), so the keyed values are not eager's."""
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(3)))
            self.proj = nn.Linear(8, 8)

    def seeded():
        return Seeded()

    class Titan(nn.Module):
        """torchtitan style: the constructor leaves a parameter empty; init_weights sets everything."""
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(24, 24)
            self.scale = nn.Parameter(torch.empty(24, 8))

        def init_weights(self):
            nn.init.trunc_normal_(self.proj.weight, std=0.002)
            nn.init.zeros_(self.proj.bias)
            nn.init.normal_(self.scale)

    def titan():
        return Titan(), {"init_method": "init_weights"}
''')

CONVS = {"stem.weight"} | {f"blocks.{b}.conv{c}.weight" for b in (0, 1) for c in (1, 2)}
ZEROED = {f"blocks.{b}.bn2.weight" for b in (0, 1)}


@pytest.fixture()
def models(tmp_path, monkeypatch):
    """The factories above, importable as ``fidelity_models``."""
    (tmp_path / "fidelity_models.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fidelity_models", None)
    import fidelity_models

    yield fidelity_models
    sys.modules.pop("fidelity_models", None)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def verdict_lines(out: str) -> dict[str, str]:
    """``{tensor: its row}`` of the fidelity table."""
    lines = out.split("fidelity:", 1)[1].splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith("tensor ")), None)
    if header is None:
        return {}
    rows = {}
    for line in lines[header + 2:]:  # after the header and its rule, up to the blank line
        if not line.strip():
            break
        rows[line.split()[0]] = line
    return rows


# --------------------------------------------------------------------------- the command line


def test_resnet_like_built_with_deferred_follows_its_own_init(capsys, models):
    before = torch.get_rng_state()
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:resnet", "--layouts", "fsdp4,tp2,pp2")
    assert torch.equal(torch.get_rng_state(), before)  # the eager builds ran inside fork_rng
    assert code == 0, out
    assert OK_LINE + "." in out
    assert not verdict_lines(out)
    assert "constructor" in next(line for line in out.splitlines() if line.startswith("stem.weight"))


def test_a_meta_build_loses_the_constructors_init_and_fidelity_names_each_tensor(capsys, models):
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:resnet", "--layouts", "fsdp2", "--build", "meta")
    assert code == 1, out
    rows = verdict_lines(out)
    assert set(rows) == CONVS | ZEROED  # torch.nn defaults instead of kaiming fan_out / the zeroed scales
    assert all("DIFFERS" in row for row in rows.values())
    assert all("distribution" in rows[name] for name in CONVS)
    assert all("exact" in rows[name] and "32 of 32 elements differ" in rows[name] for name in ZEROED)
    assert "FIDELITY: 7 tensors do not follow the model's own eager init" in out
    assert "OK" not in out.split("fidelity:", 1)[1]
    assert "32/32" in out  # the layouts themselves agree: it is the init that is not the model's


def test_a_deferred_tensor_that_does_not_follow_eager_fails_the_exit_code(capsys, models):
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:seeded", "--layouts", "fsdp2")
    assert code == 1, out
    rows = verdict_lines(out)
    assert set(rows) == {"w"} and "exact" in rows["w"] and "64 of 64 elements differ" in rows["w"]
    assert "FIDELITY: 1 tensor does not follow the model's own eager init" in out
    assert "3/3" in out  # the layouts agree


def test_a_rule_that_changes_a_distribution_is_listed_as_explained(capsys, models):
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:resnet_with_rules", "--layouts", "fsdp2,tp2")
    assert code == 0, out
    rows = verdict_lines(out)
    assert set(rows) == {"blocks.0.conv1.weight", "blocks.1.conv1.weight", "blocks.0.bn1.weight",
                         "blocks.1.bn1.weight"}
    for name in ("blocks.0.conv1.weight", "blocks.1.conv1.weight"):
        assert "explained by rule 'blocks.*.conv1.weight'" in rows[name] and "distribution" in rows[name]
    assert "explained by rule 'blocks.*.bn1.weight'" in rows["blocks.0.bn1.weight"]
    assert "exact" in rows["blocks.0.bn1.weight"]
    assert "DIFFERS" not in out
    assert OK_LINE + ", except 4 tensors that follow the rules/init_method given." in out


def test_init_method_differences_are_explained_and_empty_constructor_tensors_not_compared(models):
    result = verify(models.titan, ["fsdp2"], progress=False)
    fidelity = result["fidelity"]
    by_name = {t.fqn: t for t in fidelity.tensors}
    assert by_name["proj.weight"].status == "explained"  # trunc_normal(0.002) against Linear's default
    assert by_name["proj.weight"].explained_by == "init_method init_weights"
    assert by_name["proj.bias"].explained_by == "init_method init_weights"
    assert by_name["scale"].status == "not compared"  # eager leaves torch.empty's memory: nothing to compare
    assert "uninitialized" in by_name["scale"].why_not_compared
    assert result["ok"]


def test_a_factory_that_builds_on_meta_itself_has_no_eager_init_to_compare(capsys, models):
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:resnet_on_meta", "--layouts", "fsdp2")
    assert code == 0, out  # deferred captured its constructor even under torch.device("meta")
    assert "not checked: the factory's eager build is on the meta device" in out
    assert "NOT compared with the model's own eager init" in out
    assert OK_LINE not in out


def test_no_fidelity_builds_nothing_eagerly_and_says_what_ok_means(capsys, models, monkeypatch):
    import keyinit.cli._fidelity as fidelity

    def refuse(*args, **kwargs):
        raise AssertionError("--no-fidelity must not build the model eagerly")

    monkeypatch.setattr(fidelity, "eager_builds", refuse)
    code, out, _ = run_cli(capsys, "verify", "fidelity_models:resnet", "--layouts", "fsdp2", "--no-fidelity")
    assert code == 0, out
    assert "fidelity:" not in out
    assert "OK: bit-identical under every layout (not compared with the model's own eager init: --no-fidelity)." in out


def test_a_factory_that_calls_sys_exit_fails_instead_of_passing(capsys, models):
    code, out, err = run_cli(capsys, "verify", "fidelity_models:exits")
    assert code == 2
    assert "exits() called sys.exit(0) instead of returning a model" in err
    assert "OK" not in out
    with pytest.raises(CLIError, match=r"sys\.exit\(0\)"):
        verify(models.exits, ["fsdp2"], progress=False)


def test_a_factory_that_uses_deferred_itself(models):
    result = verify(models.resnet_deferred, ["fsdp2"], progress=False)
    assert result["ok"] and not result["fidelity"].with_status("DIFFERS")


# --------------------------------------------------------------------------- the statistics


def _ks_by_definition(a: torch.Tensor, b: torch.Tensor) -> float:
    """max over every pooled value v of |F_a(v) - F_b(v)|, each ECDF counted directly."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    points = torch.cat([a, b]).unique()
    fa = (a[None, :] <= points[:, None]).double().mean(1)
    fb = (b[None, :] <= points[:, None]).double().mean(1)
    return float((fa - fb).abs().max())


@pytest.mark.parametrize("kind", ["normal", "integers with ties", "bfloat16"])
def test_ks_statistic_is_the_two_sample_statistic(kind):
    g = torch.Generator().manual_seed(5)
    if kind == "normal":
        a, b = torch.randn(300, generator=g), 1.2 * torch.randn(211, generator=g)
    elif kind == "integers with ties":
        a, b = torch.randint(0, 5, (300,), generator=g), torch.randint(0, 6, (173,), generator=g)
    else:
        a, b = torch.randn(257, generator=g).bfloat16(), torch.randn(300, generator=g).bfloat16()
    assert ks_statistic(a, b) == pytest.approx(_ks_by_definition(a, b), abs=1e-12)


def test_ks_critical_value():
    assert ks_critical(100, 100, 0.05) == pytest.approx(1.358 * math.sqrt(2 / 100), rel=1e-3)  # the table value


def test_same_distributions_pass_and_different_ones_fail():
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        assert distribution_difference(torch.randn(4096, generator=g), torch.randn(4096, generator=g)) is None
        assert distribution_difference(torch.rand(200, generator=g), torch.rand(300, generator=g)) is None
    shape = (64, 64)
    std = math.sqrt(2 / 64)  # kaiming normal, against a uniform of a third of its std: KS and std both see it
    assert "KS" in distribution_difference(torch.randn(shape, generator=g) * std,
                                           (torch.rand(shape, generator=g) - 0.5) * std)
    wider = distribution_difference(torch.randn(100_000, generator=g) * 1.05, torch.randn(100_000, generator=g))
    assert wider is not None and wider.startswith("std ratio 1.0")  # 5% in std: KS alone would not see it
    assert "non-finite" in distribution_difference(torch.tensor([float("nan")] * 20), torch.zeros(20) + 1)


def test_compare_exact_tiny_and_shape():
    g = torch.Generator().manual_seed(3)
    ones = torch.ones(40)
    assert compare(ones.clone(), ones, ones.clone()) == ("exact", None)
    check, why = compare(torch.zeros(40), ones, ones.clone())
    assert check == "exact" and why.startswith("40 of 40 elements differ")
    a, b = torch.randn(MIN_ELEMENTS - 1, generator=g), torch.randn(MIN_ELEMENTS - 1, generator=g)
    assert compare(10 * a, a, b) == ("finite", None)  # too few to test a distribution
    assert compare(torch.full_like(a, float("inf")), a, b)[1].startswith(f"{MIN_ELEMENTS - 1} non-finite")
    assert compare(torch.zeros(3, 4), torch.zeros(4, 3), torch.zeros(4, 3))[0] == "shape/dtype"
    assert ALPHA <= 1e-6


def test_fidelity_is_skipped_when_two_eager_builds_would_not_fit_in_memory(models, monkeypatch):
    import keyinit.cli._fidelity as fidelity

    monkeypatch.setattr(fidelity, "_available_memory", lambda: 100_000)  # bytes: less than two ResNetLikes
    monkeypatch.setattr(fidelity, "eager_builds", lambda *a, **k: pytest.fail("built eagerly anyway"))
    result = verify(models.resnet, ["fsdp2"], progress=False)
    assert result["fidelity"].skipped.startswith("the two eager builds need 0.0 GiB of CPU memory")
    assert result["ok"] and not result["fidelity"].tensors


def test_torchvision_resnet_passes_with_deferred_and_fails_built_on_meta():
    """The bare torchvision ResNet: its own kaiming_normal_(fan_out) init with deferred; built on meta
    without it, torch.nn's default conv init, which fidelity catches on every 3x3 conv."""
    import functools

    from tests._support.vision import import_vision

    resnet = import_vision("torchvision.models.resnet")
    factory = functools.partial(resnet.ResNet, resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)
    result = verify(factory, ["fsdp2"], progress=False, label="resnet")
    assert result["ok"] and not result["fidelity"].with_status("DIFFERS")
    assert {p["source"] for p in result["params"]} == {"constructor"}
    result = verify(factory, ["fsdp2"], progress=False, label="resnet", build="meta")
    assert result["layouts_ok"] and not result["ok"]
    differs = {t.fqn for t in result["fidelity"].with_status("DIFFERS")}
    convs = {p["fqn"] for p in result["params"] if len(p["shape"]) == 4 and p["shape"][2:] == (3, 3)}
    assert convs and convs <= differs
    assert differs <= {p["fqn"] for p in result["params"] if len(p["shape"]) == 4}  # only conv weights
