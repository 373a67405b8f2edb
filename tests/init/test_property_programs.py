"""Property: any init program under any layout gives the single-process values bit for bit, or a PlanError.

Hypothesis generates init code (``reset_parameters``) from whole draws, pieces written through
views, temporaries (transposed, concatenated, viewed in place), element-wise updates,
re-assignment and ties, and layouts: hand-cut shards of rows, columns or listed rows, and
pipeline stages. Each layout must reproduce its region of the full model exactly; a plan that
fails must fail as a :class:`keyinit.PlanError` in the full model and in every layout alike.
"""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import keyinit
from keyinit.layouts import ManualShard

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

FIRST = ("normal", "uniform", "zeros", "temp", "temp_t", "cat", "inplace_t", "reassign")
LATER = ("rows", "cols", "scale", "add", "temp", "fill_rows")


def run_step(module: nn.Module, step: tuple) -> None:
    w = module.w
    rows, cols = w.shape
    kind = step[0]
    with torch.no_grad():
        if kind == "normal":
            w.normal_(0.0, 0.5)
        elif kind == "uniform":
            w.uniform_(-1.0, 1.0)
        elif kind == "zeros":
            w.zero_()
        elif kind == "temp":
            w.copy_(torch.randn(rows, cols) * 0.25)
        elif kind == "temp_t":
            w.copy_(torch.rand(cols, rows).t())
        elif kind == "cat":
            cut = step[1] % (rows + 1)
            w.copy_(torch.cat([torch.randn(cut, cols), torch.ones(rows - cut, cols)]))
        elif kind == "inplace_t":
            t = torch.randn(cols, rows)
            t.t_()
            w.copy_(t)
        elif kind == "reassign":
            module.w = nn.Parameter(torch.randn(rows, cols) * 0.1)
            if module.tied:
                module.v = module.w
        elif kind == "rows":
            a, b = sorted((step[1] % (rows + 1), step[2] % (rows + 1)))
            w[a:b].normal_()
        elif kind == "fill_rows":
            w[step[1] % rows].fill_(3.0)
        elif kind == "cols":
            a, b = sorted((step[1] % (cols + 1), step[2] % (cols + 1)))
            w[:, a:b].uniform_(0.0, 2.0)
        elif kind == "scale":
            w.mul_(1.5)
        elif kind == "add":
            w.add_(torch.randn(cols))
        else:  # pragma: no cover
            raise AssertionError(step)


class Program(nn.Module):
    """One weight (optionally tied under a second name) initialized by ``steps``."""

    def __init__(self, local_shape: tuple[int, int], steps: tuple, tied: bool) -> None:
        super().__init__()
        self.steps, self.tied = steps, tied
        self.w = nn.Parameter(torch.empty(local_shape))
        if tied:
            self.v = self.w

    def reset_parameters(self) -> None:
        for step in self.steps:
            run_step(self, step)


steps_strategy = st.tuples(
    st.tuples(st.sampled_from(FIRST), st.integers(0, 7)),
    st.lists(st.tuples(st.sampled_from(LATER), st.integers(0, 7), st.integers(0, 7)), max_size=3),
).map(lambda first_rest: (first_rest[0], *first_rest[1]))


def outcome(build, **kwargs):
    """The model after init_model, or the PlanError; anything else (or a global RNG draw) fails the test."""
    model = build()
    rng = torch.random.get_rng_state()
    try:
        keyinit.init_model(model, 7, **kwargs)
    except keyinit.PlanError as exc:
        return exc
    finally:
        assert torch.equal(torch.random.get_rng_state(), rng), "init_model touched the global RNG"
    return model


@st.composite
def layouts(draw, rows: int, cols: int):
    kind = draw(st.sampled_from(["rows", "cols", "listed"]))
    if kind == "rows":
        a = draw(st.integers(0, rows))
        b = draw(st.integers(a, rows))
        return (slice(a, b), slice(None))
    if kind == "cols":
        a = draw(st.integers(0, cols))
        b = draw(st.integers(a, cols))
        return (slice(None), slice(a, b))
    picked = draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows))
    return (picked, slice(None))


@SETTINGS
@given(data=st.data(), rows=st.integers(1, 6), cols=st.integers(1, 5), steps=steps_strategy, tied=st.booleans())
def test_manual_shards_give_the_full_models_values_or_the_same_plan_error(data, rows, cols, steps, tied):
    full = outcome(lambda: Program((rows, cols), steps, tied))
    region = data.draw(layouts(rows, cols))
    shard = ManualShard((rows, cols), region)
    name = data.draw(st.sampled_from(["v", "w"] if tied else ["w"]))
    local = outcome(lambda: Program(shard.region_shape, steps, tied), shards={name: shard})
    if isinstance(full, Exception):
        assert isinstance(local, keyinit.PlanError), (full, local)
        return
    assert not isinstance(local, Exception), local
    expected = full.w.detach()[tuple(torch.as_tensor(r) if isinstance(r, list) else r for r in region)]
    assert torch.equal(local.w.detach(), expected)
    if tied:
        assert local.v is local.w


class Stack(nn.Module):
    def __init__(self, programs: dict[str, tuple], shared: tuple = ()) -> None:
        super().__init__()
        self.shared = shared  # layer names that a root init_weights copies one draw into
        self.layers = nn.ModuleDict({name: Program(shape, steps, False) for name, (shape, steps) in programs.items()})

    def init_weights(self) -> None:
        held = [self.layers[name] for name in self.shared if name in self.layers]
        if held:
            draw = torch.randn(held[0].w.shape)
            with torch.no_grad():
                for layer in held:
                    layer.w.copy_(draw)


@SETTINGS
@given(data=st.data(), n=st.integers(2, 4))
def test_pipeline_stages_give_the_full_models_values_or_the_full_model_warns(data, n):
    """A stage reproduces every tensor it holds, except one the full model's SharedDrawWarning names."""
    import warnings

    shape = (data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4)))
    programs = {str(i): (shape, data.draw(steps_strategy)) for i in range(n)}
    shared = tuple(data.draw(st.lists(st.sampled_from([str(i) for i in range(n)]), max_size=3, unique=True)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", keyinit.SharedDrawWarning)
        full = outcome(lambda: Stack(programs, shared), init_method="init_weights")
    warned = " ".join(str(w.message) for w in caught if issubclass(w.category, keyinit.SharedDrawWarning))
    assert bool(warned) == (len(shared) > 1 and not isinstance(full, Exception))
    cut = data.draw(st.integers(1, n - 1))
    for held in (range(cut), range(cut, n)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", keyinit.SharedDrawWarning)  # the full model's warning is the one that counts
            stage = outcome(lambda: Stack({str(i): programs[str(i)] for i in held}, shared), strict=False,
                            init_method="init_weights")
        if isinstance(full, Exception):
            assert isinstance(stage, keyinit.PlanError) or all(
                str(i) not in full.fqns[0] for i in held), (full, stage)
            continue
        assert not isinstance(stage, Exception), stage
        for i in held:
            same = torch.equal(stage.layers[str(i)].w, full.layers[str(i)].w)
            assert same or f"'layers.{i}.w'" in warned, i


# ---------------------------------------------------------------- DTensor placements (fake process group)


@pytest.fixture(scope="module")
def fake_world():
    """A 'fake' default process group (this process plays every rank in turn)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    if dist.is_initialized():
        if dist.get_world_size() < 4:
            pytest.skip("a smaller default process group is already initialized")
        yield dist.get_world_size()
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield 4
    finally:
        dist.destroy_process_group()


MESHES = [(2,), (3,), (4,), (2, 2)]
_MESH_CACHE: dict = {}


@SETTINGS
@given(data=st.data(), rows=st.integers(1, 6), cols=st.integers(1, 5), steps=steps_strategy, tied=st.booleans())
def test_dtensor_placements_give_the_full_models_values(fake_world, data, rows, cols, steps, tied):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from keyinit.layouts import dtensor_region

    full = outcome(lambda: Program((rows, cols), steps, tied))
    mesh_shape = data.draw(st.sampled_from(MESHES))
    placements = [data.draw(st.sampled_from([Shard(0), Shard(1), Replicate()])) for _ in mesh_shape]
    if mesh_shape not in _MESH_CACHE:
        _MESH_CACHE[mesh_shape] = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape))
    mesh = _MESH_CACHE[mesh_shape]
    rank = data.draw(st.integers(0, math.prod(mesh_shape) - 1))
    coordinate = [int(c) for c in np.unravel_index(rank, mesh_shape)]
    region = dtensor_region((rows, cols), mesh_shape, tuple(coordinate), placements)

    def build():
        model = Program((rows, cols), steps, tied)
        dtensor = DTensor.from_local(torch.zeros(region.region_shape), mesh, placements, run_check=False,
                                     shape=torch.Size((rows, cols)), stride=(cols, 1))
        model.w = nn.Parameter(dtensor)
        if tied:
            model.v = model.w
        return model

    with mock.patch.object(DeviceMesh, "get_coordinate", lambda self: coordinate):  # play this rank
        local = outcome(build)
    if isinstance(full, Exception):
        assert isinstance(local, keyinit.PlanError), (full, local)
        return
    assert not isinstance(local, Exception), local
    rows_index, cols_index = region.indices
    expected = full.w.detach()[rows_index[:, None], cols_index[None, :]]
    got = local.w._local_tensor.detach()
    assert torch.equal(got, expected)
    if tied:
        assert local.v is local.w


def test_pieces_with_no_whole_write_are_captured():
    steps = (("rows", 0, 4), ("fill_rows", 4, 0), ("fill_rows", 5, 0))
    model = Program((6, 3), steps, False)
    keyinit.init_model(model, 0)
    assert torch.equal(model.w[4:], torch.full((2, 3), 3.0))
    shard = Program((2, 3), steps, False)
    keyinit.init_model(shard, 0, shards={"w": ManualShard((6, 3), (slice(2, 4), slice(None)))})
    assert torch.equal(shard.w, model.w[2:4])
