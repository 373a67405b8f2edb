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
  does) and written in place into the parameter's own storage (FSDP2's sharded storage too), all of
  a step's parameters through :func:`keyinit._draw.dispatch.sround_many` (on CUDA one launch per
  format); the parameter groups and the state hold the original parameters again. No float32 copy is kept between steps: the step holds one of each
  stepped parameter and of its gradient (8 bytes per element) while it runs;
- a step that raises (in the optimizer or in the rounding) puts the original parameters and their
  state back in the parameter groups before the exception leaves ``optimizer.step()`` (the optimizer's
  ``step`` is wrapped, as a bound method, so LR schedulers can wrap it in turn); its counter does not
  advance. A subclass whose ``step`` calls ``super().step()`` (torch runs the hooks at both levels)
  steps and counts once. What the optimizer had already done to the state tensors in place before it raised stays,
  as for any optimizer.

``fused=True`` (``torch.optim.Adam``/``AdamW`` only) steps the bfloat16/float16 parameters in one pass
instead (``docs/spec.md`` 17.6, :func:`keyinit._draw.dispatch.sround_adam_many`: on CUDA one launch per
parameter dtype): the optimizer's own step
skips them (their gradients are out of its sight while it runs), then each one's low-precision values,
gradient and float32 state are read, stepped with torch's single-tensor Adam arithmetic (a correctly
rounded square root: torch's CPU ``sqrt`` is not, so values can differ from ``fused=False`` by one
float32 unit before the rounding) and rounded into the parameter. No float32 copy of a parameter or
gradient is made: the step needs no memory beyond the state. The state is torch's (``step``,
``exp_avg``, ``exp_avg_sq``, float32), so a run can switch between the two paths at a step boundary.

torchao's low-bit optimizers (``torchao.optim._AdamW``, ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their
Adam forms, whose ``bf16_stochastic_round=True`` draws ``torch.randint`` from the global RNG) take the
float32 path unchanged: their step sees float32 parameters, so their own rounding never runs (whatever
``bf16_stochastic_round`` says) and their compiled step writes the float32 update, which is rounded as
above. Their state is made by their own ``_new_buffer`` for the original parameter (so it has the dtype
or quantized format torchao gives it) and loads as torchao loads it.

``torch.compile(optimizer.step)`` (or of a function that calls it) compiles the optimizer's own step once: the
hooks run eagerly around it (``torch.compiler.disable``, so dynamo guards on none of their Python values, the step
counter and the keys included; ``fullgraph=True`` is refused with that reason), and each parameter's float32
stand-in (and its gradient) is the same tensor object every step, its storage freed between steps, so the compiled
step's guards hold. The rounded values are the keyed rounding of what the compiled optimizer computed.

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

from keyinit._draw import dispatch
from keyinit.fqn import canonical_modules
from keyinit.keys import Key, fold_in, key, key_for, require_key
from keyinit.layouts import target_for
from keyinit.random import ROUND_TARGETS, key_words

__all__ = ["stochastic_rounding", "StochasticRounding", "STEP_KEY", "TAG"]

#: The parameter-group entry that holds the step counter (saved by ``optimizer.state_dict()``).
STEP_KEY = "stochastic_rounding_step"
#: The string folded into the root key before the step (``docs/spec.md`` 17.5).
TAG = "stochastic_rounding"
#: The parameter dtypes that ``fused=True`` steps in one pass (others take the float32 path).
_FUSED_TYPES = (torch.bfloat16, torch.float16)
#: The optimizers ``fused=True`` takes (exactly these classes: a subclass may change the arithmetic).
_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)


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

    def __init__(self, optimizer: torch.optim.Optimizer, root: Key, fqns: dict[int, str], fused: bool = False) -> None:
        if fused and type(optimizer) not in _FUSED_OPTIMIZERS:
            raise TypeError(f"stochastic_rounding: fused=True takes torch.optim.Adam or torch.optim.AdamW, got "
                            f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
        self.optimizer = optimizer
        self.torchao = _is_torchao(optimizer)
        self.fused = bool(fused)
        self._held: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # fused: (param, its gradient, its group)
        self._no_module = torch.nn.Module()  # target_for's module: the layouts read the tensor, not its owner
        self.root = root
        self._base = fold_in(root, TAG)
        self._fqns = fqns
        self._swapped: list[tuple[list, int, torch.Tensor, torch.Tensor]] = []
        # id(param) -> (param, its float32 stand-in, the layouts of the param and its gradient it was made for):
        # the same tensor objects every step (a compiled step's guards hold), their storage (and their
        # gradients') freed between steps
        self._stand_ins: dict[int, tuple[torch.Tensor, torch.nn.Parameter, tuple, tuple]] = {}
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
            optimizer.register_step_pre_hook(_eager(self._before_step)),
            optimizer.register_step_post_hook(_eager(self._after_step)),
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

    def key_words(self, step: int, fqn: str, *, device: Any = None) -> torch.Tensor:
        """:meth:`key` as an int64 tensor of shape ``(2,)`` (:func:`keyinit.random.key_words`): a compiled step's
        tensor input for :func:`keyinit.random.stochastic_round_words`."""
        return key_words(self.key(step, fqn), device=device)

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

    def _float32_copy(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """``param``'s float32 stand-in holding its values, its gradient a float32 copy of ``param``'s: the
        tensor objects of the previous step (storage allocated again) while their layout holds, new ones else."""
        grad = param.grad
        if grad is None:
            return None  # the optimizer skips it: nothing to round
        layouts = (_layout(param), _layout(grad))
        found = self._stand_ins.get(id(param))
        if found is not None and found[0] is param and found[2:] == layouts:
            stand_in = found[1]
        else:
            with torch.no_grad():
                stand_in = torch.nn.Parameter(torch.empty_like(param.detach(), dtype=torch.float32),
                                              requires_grad=param.requires_grad)
            stand_in.grad = torch.empty_like(grad.detach(), dtype=torch.float32)
            self._stand_ins[id(param)] = (param, stand_in, *layouts)
        with torch.no_grad():
            for copy, source in ((stand_in, param), (stand_in.grad, grad)):
                _allocate(copy)
                copy.detach().copy_(source.detach())
        return stand_in

    def _free(self) -> None:
        """Free the stand-ins' storage and their gradients' (their tensor objects stay for the next step)."""
        with torch.no_grad():
            for _, stand_in, _, _ in self._stand_ins.values():
                _storage(stand_in).resize_(0)
                if stand_in.grad is not None:
                    _storage(stand_in.grad).resize_(0)

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
                handle._release()
                handle._free()
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
        self._release()  # a step that raised left gradients held
        t = self.step
        for group in self.optimizer.param_groups:
            group[STEP_KEY] = t  # groups added since (add_param_group) join at the current step
        if self.fused:
            self._hold()
        if self.torchao:
            self._torchao_state()
        self._swapped = self._swap_in(self._float32_copy)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        t = self.step
        self._round_stand_ins(t)
        self._swap_out(self._swapped)
        self._free()
        try:
            self._fused_steps(t)
        finally:
            self._release()
        for group in self.optimizer.param_groups:
            group[STEP_KEY] = t + 1

    def _target(self, param: torch.Tensor, fqn: str) -> Any:
        """Where ``param`` lies in the global parameter ``fqn``: its local tensor and region (its layout's)."""
        return target_for(param.detach(), fqn=fqn, module=self._no_module, name=fqn.rpartition(".")[2])

    def _round_stand_ins(self, t: int) -> None:
        """Round each stand-in's new float32 values into its parameter with ``key(t, fqn)`` at the parameter's
        global indices (``keyinit.random.stochastic_round``'s values; every region found before any is
        written; on CUDA one launch per target format)."""
        items = []
        for _, _, param, stand_in in self._swapped:
            fqn = self._fqns[id(param)]
            target = self._target(param, fqn)
            items.append(dispatch.RoundItem(target.out, _local(stand_in, target.out, fqn, "float32 stand-in"), fqn,
                                            target.region))
        with torch.no_grad():
            dispatch.sround_many(items, fold_in(self._base, t))

    # -------------------------------------------------------------------------------- the fused step

    def _hold(self) -> None:
        """Take the gradients of the parameters the fused step will step out of the optimizer's sight
        (it skips a parameter without one), after checking every option first (nothing changed on error)."""
        held = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.dtype in _FUSED_TYPES and param.grad is not None:
                    _check_fused_group(group, self._fqns[id(param)], self.optimizer)
                    held.append((param, param.grad, group))
        for param, _, _ in held:
            param.grad = None
        self._held = held

    def _release(self) -> None:
        for param, grad, _ in self._held:
            param.grad = grad
        self._held = []

    def _fused_steps(self, t: int) -> None:
        if not self._held:
            return
        state = self.optimizer.state
        items = []
        for param, grad, group in self._held:  # every check before anything is written
            fqn = self._fqns[id(param)]
            found = state[param]
            if not found:  # as torch's Adam._init_group makes it (float32 moments)
                found["step"] = torch.tensor(0.0, dtype=torch.float64 if torch.get_default_dtype() == torch.float64
                                             else torch.float32)
                for name in ("exp_avg", "exp_avg_sq"):
                    found[name] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
            exp_avg, exp_avg_sq = found["exp_avg"], found["exp_avg_sq"]
            if exp_avg.dtype != torch.float32 or exp_avg_sq.dtype != torch.float32:
                raise TypeError(f"stochastic_rounding: fused=True needs float32 exp_avg/exp_avg_sq; {fqn!r} has "
                                f"{exp_avg.dtype}/{exp_avg_sq.dtype}")
            target = self._target(param, fqn)
            local = target.out
            items.append((found, group, dispatch.AdamItem(
                local, _local(grad, local, fqn, "gradient"), _local(exp_avg, local, fqn, "exp_avg"),
                _local(exp_avg_sq, local, fqn, "exp_avg_sq"), fqn, target.region, [], False)))
        stepped = []
        for found, group, item in items:
            step_t = found["step"]
            step_t += 1
            step = step_t.item()
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            item.scalars.extend([1 - lr * decay, 1 - beta1, beta2, 1 - beta2, (1 - beta2 ** step) ** 0.5, eps,
                                 -(lr / (1 - beta1 ** step))])
            stepped.append(item._replace(has_decay=decay != 0))
        with torch.no_grad():
            dispatch.sround_adam_many(stepped, fold_in(self._base, t))

    def _torchao_state(self) -> None:
        """A torchao optimizer's state for each low-precision parameter about to step for the first time, made
        as its step makes it but for the parameter itself (its stand-in is float32): torchao's format."""
        optimizer, state = self.optimizer, self.optimizer.state
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.dtype in ROUND_TARGETS and param.grad is not None and not state[param]:
                    found = state[param]
                    found["step"] = torch.tensor(0.0)
                    found["exp_avg"] = optimizer._new_buffer(param, True)
                    found["exp_avg_sq"] = optimizer._new_buffer(param, False)
                    if group.get("amsgrad"):
                        found["max_exp_avg_sq"] = optimizer._new_buffer(param, False)

    # -------------------------------------------------------------------------------------- loading

    def _before_load(self, optimizer: Any, state_dict: Any) -> None:
        """``load_state_dict`` casts floating state to its parameter's dtype: float32 stand-ins take the
        low-precision parameters' places while it runs, so the float32 state stays float32 (a torchao
        optimizer's state is in torchao's format: it loads as torchao loads it)."""
        if self.torchao:
            return
        self._loading = self._swap_in(lambda param: torch.empty_like(param.detach(), dtype=torch.float32))

    def _after_load(self, optimizer: Any) -> None:
        self._swap_out(self._loading)

    def remove(self) -> None:
        """Take the hooks off (the step counter stays in the parameter groups)."""
        self._swap_out(self._swapped)
        self._swap_out(self._loading)
        self._stand_ins.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._unwrap_step()


def _eager(hook: Any) -> Any:
    """``hook`` run eagerly under ``torch.compile``: a graph break (dynamo does not trace it, so it guards on none
    of the Python values it reads, such as the step counter)."""
    def run(optimizer: Any, args: Any, kwargs: Any) -> None:
        hook(optimizer, args, kwargs)

    run.__qualname__ = run.__name__ = f"stochastic_rounding{hook.__name__}"
    try:
        return torch.compiler.disable(run, reason=_EAGER_REASON)
    except TypeError:  # torch before 2.7 takes no reason
        return torch.compiler.disable(run)


#: Why the hooks break the graph (shown by dynamo, e.g. under ``fullgraph=True``).
_EAGER_REASON = ("keyinit.optim.stochastic_rounding's step hooks (the float32 stand-ins and the keyed rounding) run "
                 "eagerly between the compiled parts of optimizer.step(); compile the step without fullgraph=True "
                 "(torch's own optimizers break the graph there too)")


def _storage(tensor: torch.Tensor) -> Any:
    """The untyped storage of ``tensor`` (a DTensor's local tensor's)."""
    local = tensor.to_local() if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "to_local") \
        else tensor
    return local.untyped_storage()


def _allocate(tensor: torch.Tensor) -> None:
    """Give a stand-in (freed by ``_free``) its storage again."""
    local = tensor.to_local() if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "to_local") \
        else tensor
    needed = (local.storage_offset() + sum((n - 1) * s for n, s in zip(local.shape, local.stride())) + 1) \
        * local.element_size() if local.numel() else 0
    storage = local.untyped_storage()
    if storage.nbytes() < needed:
        storage.resize_(needed)


def _layout(tensor: torch.Tensor) -> tuple:
    """What a stand-in made for ``tensor`` depends on: its type, shape, strides, dtype, device (and placements)."""
    return (type(tensor.detach()), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device,
            tuple(getattr(tensor, "placements", ())))


def _is_torchao(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torchao's Adam/AdamW optimizers (``torchao.optim.adam._AdamBase``),
    recognised without importing torchao."""
    for cls in type(optimizer).__mro__:
        if cls.__name__ == "_AdamBase" and cls.__module__.startswith("torchao."):
            if not callable(getattr(optimizer, "_new_buffer", None)):
                raise TypeError(f"stochastic_rounding: {type(optimizer).__qualname__} is a torchao optimizer without "
                                "_new_buffer (a torchao version keyinit does not know); its state cannot be made")
            return True
    return False


def _local(tensor: torch.Tensor, param_local: torch.Tensor, fqn: str, what: str) -> torch.Tensor:
    """``tensor``'s local part (a DTensor's ``to_local()``), which must have the parameter's local shape."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    local = local.detach()
    if local.shape != param_local.shape:
        raise ValueError(f"stochastic_rounding: the {what} of {fqn!r} has local shape {tuple(local.shape)}, its "
                         f"parameter {tuple(param_local.shape)}")
    return local


def _check_fused_group(group: dict, fqn: str, optimizer: torch.optim.Optimizer) -> None:
    """The options of ``fqn``'s parameter group that the fused step computes as torch's Adam/AdamW would."""
    for option, plain in (("amsgrad", False), ("maximize", False), ("capturable", False),
                          ("differentiable", False)):
        if bool(group.get(option, plain)) != plain:
            raise ValueError(f"stochastic_rounding: fused=True does not step {option}={group[option]!r} "
                             f"(parameter {fqn!r}); use fused=False")
    if group.get("fused"):
        raise ValueError(f"stochastic_rounding: fused=True does not take torch's fused=True (parameter {fqn!r})")
    for option in ("lr", "eps", "weight_decay"):
        if isinstance(group[option], bool) or not isinstance(group[option], (int, float)):
            raise TypeError(f"stochastic_rounding: fused=True needs a Python number for {option}, got "
                            f"{type(group[option]).__name__} (parameter {fqn!r})")
    if any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in group["betas"]):
        raise TypeError(f"stochastic_rounding: fused=True needs Python numbers for betas (parameter {fqn!r})")
    decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
    if group["weight_decay"] != 0 and not decoupled:
        raise ValueError(f"stochastic_rounding: fused=True steps decoupled weight decay only (AdamW); Adam's "
                         f"weight_decay={group['weight_decay']!r} adds it to the gradient (parameter {fqn!r}); use "
                         "AdamW, decoupled_weight_decay=True or fused=False")


def stochastic_rounding(optimizer: torch.optim.Optimizer, seed: Union[int, Key], *,
                        names: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
                        fused: bool = False) -> StochasticRounding:
    """Make ``optimizer`` step its bfloat16/float16/float8 parameters in float32 and round the results
    stochastically, keyed by (``seed``, step, canonical FQN, global index).

    ``seed``: an int or a :class:`~keyinit.Key`. ``names``: the model (canonical FQNs, wrappers
    stripped, as for initialization) or a mapping of FQNs to the optimizer's parameters. Parameters of
    other dtypes step as usual. ``fused=True`` (``torch.optim.Adam``/``AdamW``): the bfloat16/float16
    parameters step in one pass with no float32 copies (``docs/spec.md`` 17.6). A torchao Adam/AdamW
    optimizer (``bf16_stochastic_round`` or not) is keyed the same way: its step computes the float32
    update and this rounds it. Call it after the optimizer is made (and after ``fully_shard``); save
    and load ``optimizer.state_dict()`` as usual. Returns the hooks' handle (``.step``, ``.key(t, fqn)``,
    ``.remove()``).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"stochastic_rounding: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    root = key(seed) if isinstance(seed, int) and not isinstance(seed, bool) else require_key(seed, "seed")
    return StochasticRounding(optimizer, root, _names_of(names), fused)
