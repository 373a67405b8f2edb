"""Stochastically rounded optimizer steps, keyed by (seed, step, the parameter's canonical FQN, global index).

:func:`stochastic_rounding` makes any ``torch.optim`` optimizer over bfloat16/float16 (or float8)
parameters compute its step in float32 and round the new values stochastically back into the
parameters (``keyinit.random.stochastic_round``, ``docs/spec.md`` 17.5):

- before each ``optimizer.step()``, every low-precision parameter that has a gradient is replaced in
  the optimizer's parameter groups by a float32 copy of itself whose gradient is a float32 copy of
  its gradient (its optimizer state moves along); the optimizer steps those (its state tensors are
  created in float32, as for a float32 parameter). Works for plain and DTensor parameters alike;
- after the step, the new float32 values are rounded with the key
  ``key_for(fold_in(fold_in(key(seed), "stochastic_rounding"), t), fqn)`` at every element's
  GLOBAL index (a DTensor parameter by its placements, so FSDP2 and TP shards round as one process
  does) and written in place into the parameter's own storage (FSDP2's sharded storage too); the
  parameter groups and the state hold the original parameters again. No float32 copy is kept between steps: the step holds one of each
  stepped parameter and of its gradient (8 bytes per element) while it runs;
- a step that raises (in the optimizer or in the rounding) puts the original parameters and their
  state back in the parameter groups before the exception leaves ``optimizer.step()`` (the optimizer's
  ``step`` is wrapped, as a bound method, so LR schedulers can wrap it in turn); its counter does not
  advance. A subclass whose ``step`` calls ``super().step()`` (torch runs the hooks at both levels)
  steps and counts once. What the optimizer had already done to the state tensors in place before it raised stays,
  as for any optimizer.

The step counter ``t`` (0 for the first step) lives in every parameter group as
:data:`STEP_KEY`, so ``optimizer.state_dict()`` saves it and ``load_state_dict`` restores it: a
resumed run continues the same keys. Loading also keeps the float32 optimizer state float32
(``load_state_dict`` otherwise casts state to the parameter's dtype). Never reads the global RNG.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from keyinit.fqn import canonical_modules
from keyinit.keys import Key, fold_in, key, key_for, require_key
from keyinit.random import ROUND_TARGETS, stochastic_round

__all__ = ["stochastic_rounding", "StochasticRounding", "STEP_KEY", "TAG"]

#: The parameter-group entry that holds the step counter (saved by ``optimizer.state_dict()``).
STEP_KEY = "stochastic_rounding_step"
#: The string folded into the root key before the step (``docs/spec.md`` 17.5).
TAG = "stochastic_rounding"


def _names_of(names: Union[torch.nn.Module, Mapping[str, torch.Tensor]]) -> dict[int, str]:
    """``{id(parameter): canonical FQN}``; a parameter reachable by several names takes its first, as
    ``named_parameters`` and DCP do."""
    found: dict[int, str] = {}
    if isinstance(names, torch.nn.Module):
        for _, canonical, module in canonical_modules(names):
            for name, param in module._parameters.items():
                if param is not None and id(param) not in found:
                    found[id(param)] = f"{canonical}.{name}" if canonical else name
        return found
    if isinstance(names, Mapping):
        for fqn, param in names.items():
            if not isinstance(fqn, str) or not fqn or not isinstance(param, torch.Tensor):
                raise TypeError(f"stochastic_rounding: names must map FQN strings to parameters, got {fqn!r}: "
                                f"{type(param).__name__}")
            found.setdefault(id(param), fqn)
        return found
    raise TypeError(f"stochastic_rounding: names must be the model (an nn.Module) or a mapping of FQNs to its "
                    f"parameters, got {type(names).__name__}")


class StochasticRounding:
    """The hooks :func:`stochastic_rounding` put on an optimizer; :meth:`remove` takes them off."""

    def __init__(self, optimizer: torch.optim.Optimizer, root: Key, fqns: dict[int, str]) -> None:
        self.optimizer = optimizer
        self.root = root
        self._base = fold_in(root, TAG)
        self._fqns = fqns
        self._swapped: list[tuple[list, int, torch.Tensor, torch.Tensor]] = []
        self._loading: list[tuple[list, int, torch.Tensor, torch.Tensor]] = []
        self._depth = 0  # steps entered and not yet left (the hooks of nested step calls)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.dtype in ROUND_TARGETS and id(param) not in fqns:
                    raise ValueError(f"stochastic_rounding: a {param.dtype} parameter of shape {tuple(param.shape)} "
                                     "in the optimizer is not a parameter of `names`; pass the model that holds "
                                     "the optimizer's parameters (after fully_shard/parallelize)")
            group.setdefault(STEP_KEY, 0)
        self._wrap_step()
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            optimizer.register_load_state_dict_pre_hook(self._before_load),
            optimizer.register_load_state_dict_post_hook(self._after_load),
        ]

    @property
    def step(self) -> int:
        """The number of steps taken under this key (the next step's ``t``)."""
        steps = {group.setdefault(STEP_KEY, 0) for group in self.optimizer.param_groups}
        if len(steps) != 1:
            raise ValueError(f"stochastic_rounding: the optimizer's parameter groups hold different steps {sorted(steps)} "
                             f"in {STEP_KEY!r}; they must agree")
        return int(steps.pop())

    def key(self, step: int, fqn: str) -> Key:
        """The key that rounds parameter ``fqn`` at step ``step`` (``docs/spec.md`` 17.5)."""
        return key_for(fold_in(self._base, step), fqn)

    # -------------------------------------------------------------------------------------- the step

    def _swap_in(self, make: Any) -> list[tuple[list, int, torch.Tensor, torch.Tensor]]:
        """Put ``make(param)`` (a float32 stand-in) in each low-precision parameter's place in the parameter
        groups, its optimizer state moved along; returns ``(group list, position, param, stand-in)``."""
        swapped = []
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            params = group["params"]
            for position, param in enumerate(params):
                if param.dtype not in ROUND_TARGETS:
                    continue
                stand_in = make(param)
                if stand_in is None:
                    continue
                params[position] = stand_in  # in place: optimizers that keep the list (LBFGS) see it too
                if param in state:
                    state[stand_in] = state.pop(param)
                swapped.append((params, position, param, stand_in))
        return swapped

    def _swap_out(self, swapped: list[tuple[list, int, torch.Tensor, torch.Tensor]]) -> None:
        state = self.optimizer.state
        for params, position, param, stand_in in swapped:
            params[position] = param
            if stand_in in state:
                state[param] = state.pop(stand_in)
        swapped.clear()

    @staticmethod
    def _float32_copy(param: torch.Tensor) -> Optional[torch.Tensor]:
        if param.grad is None:
            return None  # the optimizer skips it: nothing to round
        with torch.no_grad():
            copy = torch.nn.Parameter(param.detach().to(torch.float32), requires_grad=param.requires_grad)
        copy.grad = param.grad.detach().to(torch.float32)
        return copy

    def _wrap_step(self) -> None:
        """Make ``optimizer.step`` put the parameters back when the step raises (a bound method on the
        instance, calling the one it shadows: the class's, hooks included, or an earlier wrapper)."""
        optimizer = self.optimizer
        self._had_step = "step" in vars(optimizer)
        self._inner_step = optimizer.step
        handle = self

        def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return handle._inner_step(*args, **kwargs)
            except BaseException:
                handle._depth = 0  # the post-hooks did not run
                handle._swap_out(handle._swapped)  # nothing half-done stays in the parameter groups
                raise

        self._step = types.MethodType(step, optimizer)
        optimizer.step = self._step

    def _unwrap_step(self) -> None:
        optimizer = self.optimizer
        if vars(optimizer).get("step") is not self._step:
            return  # wrapped again since (an LR scheduler): ours stays and only passes through
        if self._had_step:
            optimizer.step = self._inner_step
        else:
            del optimizer.step

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # A subclass whose step calls super().step() runs the hooks at both levels: only the outer acts
        self._depth += 1
        if self._depth > 1:
            return
        self._swap_out(self._swapped)  # a step that raised left its copies in place
        t = self.step
        for group in self.optimizer.param_groups:
            group[STEP_KEY] = t  # groups added since (add_param_group) join at the current step
        self._swapped = self._swap_in(self._float32_copy)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        t = self.step
        with torch.no_grad():
            for _, _, param, stand_in in self._swapped:
                stochastic_round(self.key(t, self._fqns[id(param)]), stand_in.detach(), param.dtype, out=param.detach())
        self._swap_out(self._swapped)
        for group in self.optimizer.param_groups:
            group[STEP_KEY] = t + 1

    # -------------------------------------------------------------------------------------- loading

    def _before_load(self, optimizer: Any, state_dict: Any) -> None:
        """``load_state_dict`` casts floating state to its parameter's dtype: float32 stand-ins take the
        low-precision parameters' places while it runs, so the float32 state stays float32."""
        self._loading = self._swap_in(lambda param: torch.empty_like(param.detach(), dtype=torch.float32))

    def _after_load(self, optimizer: Any) -> None:
        self._swap_out(self._loading)

    def remove(self) -> None:
        """Take the hooks off (the step counter stays in the parameter groups)."""
        self._swap_out(self._swapped)
        self._swap_out(self._loading)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._unwrap_step()


def stochastic_rounding(optimizer: torch.optim.Optimizer, seed: Union[int, Key], *,
                        names: Union[torch.nn.Module, Mapping[str, torch.Tensor]]) -> StochasticRounding:
    """Make ``optimizer`` step its bfloat16/float16/float8 parameters in float32 and round the results
    stochastically, keyed by (``seed``, step, canonical FQN, global index).

    ``seed``: an int or a :class:`~keyinit.Key`. ``names``: the model (canonical FQNs, wrappers
    stripped, as for initialization) or a mapping of FQNs to the optimizer's parameters. Parameters of
    other dtypes step as usual. Call it after the optimizer is made (and after ``fully_shard``); save
    and load ``optimizer.state_dict()`` as usual. Returns the hooks' handle (``.step``, ``.key(t, fqn)``,
    ``.remove()``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"stochastic_rounding: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = key(seed) if isinstance(seed, int) and not isinstance(seed, bool) else require_key(seed, "seed")
    return StochasticRounding(optimizer, root, _names_of(names))
