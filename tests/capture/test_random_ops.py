"""Every random op torch has, called from init code: keyed, or an UnkeyedRandomnessError; never the global RNG.

The ops are enumerated from torch's own registry (every aten overload tagged
``nondeterministic_seeded``, plus ``random``/``random_``), so a random op added to
torch fails :func:`test_every_random_op_is_classified` until it is handled here.
Each op is called from a module's ``reset_parameters`` on the module's parameter,
on a view of it and on a temporary that is then copied in, with and without
``generator=``: a keyed op gives the same values under any global seed and leaves
the global RNG state as it was; an unkeyable one raises before anything is written.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
from torch import nn

import keyinit
from keyinit._engine.programs.random_ops import is_random, keyed_effects

SHAPE = (4, 6)

#: Fused kernels (attention, RNNs) and device-specific ops: checked by classification (they become
#: unkeyable draws), since they have no CPU kernel or need inputs of their own kind.
_SPECIAL = re.compile(r"cudnn|miopen|flash|efficient|_mps|fused_attention|_fused_sdp|mem_eff|_nested|lstm|gru|"
                      r"rnn_relu|rnn_tanh|scaled_dot|_fused_dropout")
#: Ops with no exact inversion from uniform words.
_UNKEYABLE_BASES = {"poisson", "binomial", "_standard_gamma", "_sample_dirichlet"}


def all_random_overloads() -> list[Any]:
    found = []
    for full in sorted(torch._C._dispatch_get_all_op_names()):
        if not full.startswith("aten::"):
            continue
        base, _, overload = full[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if is_random(op):
            found.append(op)
    return found


RANDOM_OPS = all_random_overloads()
CALLABLE = [op for op in RANDOM_OPS if not _SPECIAL.search(str(op))]
SPECIAL = [op for op in RANDOM_OPS if _SPECIAL.search(str(op))]


def base_name(op: Any) -> str:
    return op._schema.name.replace("aten::", "").rstrip("_")


def expected_unkeyable(op: Any) -> bool:
    return base_name(op) in _UNKEYABLE_BASES or (base_name(op) == "randint_like" and "Tensor" in op._overloadname)


def _value(op: Any, arg: Any, target: torch.Tensor, probabilities: torch.Tensor, generator: Any) -> Any:
    """An argument for ``op``'s schema argument ``arg``."""
    kind = str(arg.type)
    name = arg.name
    base = base_name(op)
    if kind.startswith("Tensor") and "[]" not in kind:
        if arg.alias_info is not None and arg.alias_info.is_write:
            if name == "out1":  # native_dropout's mask
                return torch.empty(tuple(target.shape), dtype=torch.bool)
            if name == "noise":  # rrelu's slopes
                return torch.empty(tuple(target.shape))
            return target.detach() if arg.kwarg_only else target  # out= into a parameter goes through .detach()
        if base in ("uniform", "normal", "rand_like", "randn_like", "randint_like", "exponential", "geometric",
                    "log_normal", "cauchy", "random") and name == "self":
            return target
        if base == "randint_like" and name == "high":
            return torch.tensor(5)
        if base.startswith("rrelu"):
            return -probabilities  # negative inputs get the random slope
        return probabilities[: target.shape[0]] if base == "multinomial" else probabilities
    if "Generator" in kind:
        return generator
    if "SymInt[]" in kind or "int[]" in kind or "List[int]" in kind:
        return list(target.shape)
    if name in ("n",):
        return target.numel()
    if name == "num_samples":
        return 3
    if name in ("low", "from"):
        return 0
    if name in ("high", "to"):
        return 5
    if name in ("p",) and "float" in kind:
        return 0.3
    if name in ("train", "training"):
        return True
    if arg.has_default_value():
        return arg.default_value
    if "float" in kind:
        return {"mean": 0.0, "std": 1.0, "lambd": 1.0}.get(name, 0.5)
    if kind.startswith("Optional[") or kind.endswith("?"):
        return None
    raise NotImplementedError(f"{op}: no test value for argument {name}: {kind}")


def init_code(op: Any, where: str, generator: Any) -> Callable[[nn.Module], None]:
    def reset(module: nn.Module) -> None:
        negative = base_name(op).startswith("rrelu")  # rrelu draws slopes for negative inputs only
        with torch.no_grad():
            nn.init.uniform_(module.w, *((-0.9, -0.1) if negative else (0.1, 0.9)))  # valid probabilities / rates
            start = -0.5 if negative else 0.5
            target = {"param": module.w, "view": module.w[1:], "temporary": torch.full(SHAPE, start)}[where]
            probabilities = torch.full(tuple(target.shape), 0.3)
            args, kwargs = [], {}
            for arg in op._schema.arguments:
                value = _value(op, arg, target, probabilities, generator)
                if arg.kwarg_only:
                    kwargs[arg.name] = value
                else:
                    args.append(value)
            result = op(*args, **kwargs)
            produced = result[0] if isinstance(result, tuple) else result
            if where == "temporary" or produced is not target:
                flat = module.w.view(-1)
                values = target if produced is target else produced
                flat[: values.numel()].copy_(values.reshape(-1).to(flat.dtype))

    return reset


class Walker(nn.Module):
    def __init__(self, reset: Callable[[nn.Module], None]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SHAPE))
        self._reset = reset

    def reset_parameters(self) -> None:
        self._reset(self)


def test_every_random_op_is_classified():
    """The walk covers torch's whole registry: an op neither keyed nor known-unkeyable fails here."""
    assert len(RANDOM_OPS) > 100 and len(CALLABLE) > 60
    names = {str(op) for op in RANDOM_OPS}
    for expected in ("aten.normal_.default", "aten.randn.default", "aten.random_.from", "aten.bernoulli.p",
                     "aten.randperm.default", "aten.rrelu_with_noise.default", "aten.poisson.default"):
        assert expected in names


@pytest.mark.parametrize("op", SPECIAL, ids=str)
def test_fused_kernels_become_unkeyable_draws(op):
    outputs = [torch.empty(3, device="meta")]
    effects = keyed_effects(op, (), {}, outputs, "Walker at <root>", lambda t: None)  # type: ignore[arg-type]
    nodes = [*effects.returns, *(value for _, value in effects.writes)]
    nodes = [n for n in nodes if n is not None]
    assert nodes and all(getattr(n, "unkeyable", None) for n in nodes)


@pytest.mark.parametrize("generator", [None, "generator"])
@pytest.mark.parametrize("where", ["param", "view", "temporary"])
@pytest.mark.parametrize("op", CALLABLE, ids=str)
def test_random_op_in_init_code_is_keyed_or_raises(op, where, generator):
    gen = torch.Generator().manual_seed(5) if generator else None
    if base_name(op) in ("randperm", "multinomial") and any(
            a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        # out= of another shape: torch resizes it, which keyinit refuses (it captures fixed shapes)
        with pytest.raises(keyinit.PlanError, match=r"resizes the tensor it writes into"):
            keyinit.init_model(Walker(init_code(op, where, gen)), 0)
        return
    torch.manual_seed(1)
    before = torch.get_rng_state()
    model = Walker(init_code(op, where, gen))
    if expected_unkeyable(op):
        with pytest.raises(keyinit.UnkeyedRandomnessError, match=rf"Walker at <root>: .*{base_name(op).lstrip('_')}"):
            keyinit.init_model(model, 0)
        assert torch.equal(model.w, torch.zeros(SHAPE))  # raised while planning: nothing written
        assert torch.equal(before, torch.get_rng_state())
        return
    keyinit.init_model(model, 0)
    assert torch.equal(before, torch.get_rng_state()), "the global RNG was read or advanced"
    torch.manual_seed(2)
    again = Walker(init_code(op, where, gen))
    keyinit.init_model(again, 0)
    assert torch.equal(model.w, again.w), "values depend on the global seed"
    other_seed = Walker(init_code(op, where, gen))
    keyinit.init_model(other_seed, 1)
    assert not torch.equal(other_seed.w, model.w), "the keyed seed does not reach the draw"
