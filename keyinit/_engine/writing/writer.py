"""Writing a plan into the model: the writer (lowest precedence first), its undo, its progress and its report.

:class:`Writer` replays each planned tensor's program for the region this process holds
(:mod:`keyinit._engine.programs.replay` through :meth:`~keyinit._engine.planning.planned.ModelPlan.write`), lowest
precedence first (constructor records, built-in defaults, init code, module rules, FQN patterns),
so a failure part-way leaves an exact record of what was written: :class:`Undo` puts the failing
tensor back as it was. :func:`materialize_plan` allocates a meta model first and returns it to the
meta device if anything fails. :class:`InitReport` (with one :class:`TensorRecord` per tensor) is
what ``init_model`` and ``materialize`` return.
"""

from __future__ import annotations

import math
import time
from typing import Optional, Union

import attrs
import torch

from keyinit.errors import InitError
from keyinit.init import Initializer
from keyinit._engine.writing.kept import recompute_derived, to_empty_except
from keyinit._engine.planning.planned import ModelPlan, PlannedTensor
from keyinit._engine.programs.program import Const, Random, iter_nodes
from keyinit._engine.writing.progress import Progress

__all__ = ["TensorRecord", "InitReport", "Writer", "Undo", "write_plan", "materialize_plan"]


@attrs.frozen
class TensorRecord:
    """One line of the report: how a tensor was initialized."""

    fqn: str
    key_fqn: str
    kind: str  # "parameter" or "buffer"
    source: str  # which rule wrote it last, or "kept"
    global_numel: int
    local_numel: int
    layout: str
    element_local: bool = True


@attrs.frozen
class InitReport:
    """What ``init_model`` did. ``str(report)`` is a table."""

    seed: int
    stream: str
    records: tuple[TensorRecord, ...]
    seconds: float
    notes: tuple[str, ...] = ()  # e.g. init code that failed where rules cover everything it writes

    @property
    def parameters(self) -> int:
        return sum(r.kind == "parameter" and r.source != "kept" for r in self.records)

    @property
    def elements(self) -> int:
        """Global elements of the initialized tensors."""
        return sum(r.global_numel for r in self.records if r.source != "kept")

    @property
    def local_elements(self) -> int:
        """Elements this process generated."""
        return sum(r.local_numel for r in self.records if r.source != "kept")

    @property
    def non_local(self) -> tuple[str, ...]:
        """Tensors whose values are computed whole on every process (orthogonal, reductions in init code)."""
        return tuple(r.fqn for r in self.records if not r.element_local)

    @property
    def defaults(self) -> tuple[str, ...]:
        """Tensors that got torch.nn's default initialization (``default Linear``, ...), not the
        model's own init code: build the model with :func:`keyinit.deferred` to record its
        constructor's init, or pass ``init_method=``."""
        return tuple(r.fqn for r in self.records if r.source.startswith("default "))

    def by_source(self) -> dict[str, list[str]]:
        grouped: dict[str, list[str]] = {}
        for r in self.records:
            grouped.setdefault(r.source, []).append(r.fqn)
        return grouped

    def __str__(self) -> str:
        width = max([len(r.fqn) for r in self.records] + [3])
        source_width = max([len(r.source) for r in self.records] + [6])
        lines = [
            f"keyinit: seed={self.seed} stream={self.stream} tensors={len(self.records)} "
            f"parameters={self.parameters} elements={self.elements} local={self.local_elements} "
            f"time={self.seconds:.3f}s",
            f"{'fqn':<{width}}  {'source':<{source_width}} {'local/global':>21}  layout",
        ]
        for r in self.records:
            flag = "  [draws full tensor on every rank]" if not r.element_local else ""
            tied = f" (key of {r.key_fqn})" if r.key_fqn != r.fqn else ""
            lines.append(
                f"{r.fqn:<{width}}  {r.source:<{source_width}} {r.local_numel:>10}/{r.global_numel:<10}  {r.layout}{tied}{flag}"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


class Writer:
    """Writes every planned tensor into its target (this process's region), lowest precedence first."""

    def __init__(self, plan: ModelPlan, progress: Optional[bool], device: Union[torch.device, str, None] = None) -> None:
        self.plan = plan
        self.device = device
        self.written: list[PlannedTensor] = []
        self.partial: Optional[str] = None  # a tensor a failed write may have left partly written
        self.layouts: dict[int, tuple[str, int]] = {}
        total = sum(math.prod(t.global_shape) for t in plan.tensors if t.program is not None)
        self.progress = Progress(total, "keyinit", enabled=progress if progress is not None else total >= 1 << 28)

    def order(self) -> list[PlannedTensor]:
        rank = {name: i for i, name in enumerate(("constructor", "default", "code", "rule", "pattern"))}
        todo = [t for t in self.plan.tensors if t.program is not None]
        return sorted(todo, key=lambda t: rank.get(t.origin, 0))  # stable: model order within a class

    def run(self) -> None:
        try:
            with torch.no_grad():
                for tensor in self.order():
                    self._write(tensor)
        except Exception as exc:
            written = tuple(t.fqn for t in self.written)
            raise InitError(
                f"initialization failed part-way ({type(exc).__name__}: {exc}); these tensors were already "
                f"written: {list(written) or 'none'}; "
                + (f"{self.partial} may be partly written; " if self.partial else "")
                + "every other tensor is unchanged",
                written,
            ) from exc
        finally:
            self.progress.close()

    def _write(self, tensor: PlannedTensor) -> None:
        undo = Undo(tensor, self.plan, keep_values=self.device is None and _may_fail_part_way(tensor))
        try:
            self._write_unguarded(tensor)
        except BaseException:
            undo()  # the failing tensor is put back as it was: InitError.written stays exact
            if undo.saved is None and self.device is None and not (tensor.new or tensor.recreated):
                self.partial = tensor.fqn  # a keyinit initializer stopped by an interrupt or out of memory
            raise

    def _write_unguarded(self, tensor: PlannedTensor) -> None:
        if tensor.new:
            self._create(tensor)
        elif tensor.recreated:
            self._recreate(tensor)
        target = self.plan.target(tensor)
        self.plan.write(tensor, target)
        for module, attr in tensor.distinct_alias_tensors():
            self.plan.write(tensor, self.plan.target(tensor, module, attr))
        local = self.plan.element_local(tensor)
        self.layouts[id(tensor)] = (target.description, target.out.numel() if local else math.prod(target.global_shape))
        self.written.append(tensor)
        self.progress.update(math.prod(tensor.global_shape), tensor.fqn)

    @staticmethod
    def _recreate(tensor: PlannedTensor) -> None:
        """Init code assigned a buffer of a new shape or dtype: give the module a plain tensor of it."""
        old = tensor.tensor
        local = getattr(old, "_local_tensor", old)
        fresh = torch.empty(tensor.global_shape, dtype=tensor.dtype, device=local.device)
        for module, attr in tensor.locations():
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(fresh, requires_grad=old.requires_grad)
            else:
                module._buffers[attr] = fresh

    def _create(self, tensor: PlannedTensor) -> None:
        """A tensor init code created where there was none: a plain tensor on the module's device."""
        module = tensor.module
        device = self.device
        if device is None:
            existing = next(iter([*module.parameters(), *module.buffers()]), None)
            local = getattr(existing, "_local_tensor", existing)
            device = local.device if local is not None else "cpu"
        fresh = torch.empty(tensor.global_shape, dtype=tensor.dtype, device=device)
        if tensor.kind == "parameter":
            module.register_parameter(tensor.attr, torch.nn.Parameter(fresh))
        elif tensor.kind.startswith("buffer"):
            module.register_buffer(tensor.attr, fresh, persistent=tensor.kind == "buffer")
        else:
            setattr(module, tensor.attr, fresh)

    def report(self, seconds: float) -> InitReport:
        records = []
        for t in self.plan.tensors:
            layout, local = self.layouts.get(id(t), (None, 0))
            if layout is None and t.new:
                layout = "not created"
            elif layout is None:
                tensor = t.tensor
                layout = "meta" if tensor.device.type == "meta" else self.plan.target(t).description
            source = t.source if id(t) in self.layouts else "kept"
            records.append(TensorRecord(t.fqn, t.key_fqn, t.kind, source, math.prod(t.global_shape), local, layout,
                                        self.plan.element_local(t)))
        return InitReport(self.plan.seed, self.plan.root_key.stream, tuple(records), seconds, self.plan.notes)


class Undo:
    """What puts one tensor back as it was before the writer touched it: its module entries (init code
    may re-create or create it) and, for ``init_model``, its local values (a fill that fails part-way
    must not leave it half-written)."""

    def __init__(self, tensor: PlannedTensor, plan: ModelPlan, keep_values: bool) -> None:
        self.entries = [(module, attr, module._parameters.get(attr, _ABSENT), module._buffers.get(attr, _ABSENT),
                         vars(module).get(attr, _ABSENT), attr in module._non_persistent_buffers_set)
                        for module, attr in tensor.locations()]
        self.saved = None
        if keep_values and not tensor.new and not tensor.recreated:
            out = plan.target(tensor).out
            self.saved = (out, out.detach().clone())

    def __call__(self) -> None:
        with torch.no_grad():
            if self.saved is not None:
                self.saved[0].copy_(self.saved[1])
        for module, attr, parameter, buffer, plain, non_persistent in self.entries:
            for table, old in ((module._parameters, parameter), (module._buffers, buffer)):
                if old is _ABSENT:
                    table.pop(attr, None)
                else:
                    table[attr] = old
            if plain is _ABSENT:
                vars(module).pop(attr, None)
            else:
                vars(module)[attr] = plain
            if non_persistent:
                module._non_persistent_buffers_set.add(attr)
            else:
                module._non_persistent_buffers_set.discard(attr)


_ABSENT = object()


def _may_fail_part_way(tensor: PlannedTensor) -> bool:
    """Whether writing ``tensor`` runs code that can fail after writing part of it (an Initializer subclass
    of the user's own too): anything but keyinit's own initializers, keyed draws and constants, which
    planning already checked (their tensors are not copied first; only an interrupt or running out of
    memory can stop them, and the InitError says so)."""
    if tensor.program is None or tensor.new or tensor.recreated:
        return False
    if tensor.origin in ("rule", "pattern", "default") and tensor.rule is not None:
        rule = tensor.rule[2]
        return not (isinstance(rule, Initializer) and type(rule).__module__.startswith("keyinit."))
    # init code: only keyed draws and constants (kernel fills, checked while planning) need no copy
    return not all(isinstance(node, (Random, Const)) for node in iter_nodes(tensor.program.roots()))


def write_plan(plan: ModelPlan, progress: Optional[bool], started: float) -> InitReport:
    """Write every tensor of an allocated model (``init_model``); its report (timed from ``started``)."""
    writer = Writer(plan, progress)
    writer.run()
    return writer.report(time.perf_counter() - started)


def materialize_plan(plan: ModelPlan, progress: Optional[bool], device: Union[torch.device, str, None],
                     started: float) -> InitReport:
    """Allocate a meta model on ``device`` (default: cuda when available) and write it (``materialize``); on
    any failure the model is returned to the meta device."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = plan.model
    kept = plan.kept  # loaded into the meta model: not written (decided while planning, keyinit._engine.writing.kept)
    writer = Writer(plan, progress, device)
    marks = [(t, dict(vars(t.tensor))) for t in plan.tensors if not t.new]
    undo_created = [Undo(t, plan, keep_values=False) for t in plan.tensors if t.new or t.recreated]
    try:
        to_empty_except(model, kept, device)
        _retie(plan)
        for tensor, attributes in marks:  # to_empty makes new tensors: keep their markers (megatron's, HF's)
            for name, value in attributes.items():
                if not hasattr(tensor.tensor, name):
                    setattr(tensor.tensor, name, value)
        writer.run()
        recompute_derived(model)  # torch's hook-based weight_norm / spectral_norm / pruning weights
    except BaseException as exc:
        for undo in undo_created:  # what init code created or re-created: the model's own tensors again
            undo()
        to_empty_except(model, kept, "meta", base=True)  # the base method: an override may be what failed
        for tensor in plan.tensors:
            if tensor.new and tensor.kind == "attribute" and tensor.attr in vars(tensor.module):
                delattr(tensor.module, tensor.attr)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: the model is back on meta
        written = exc.written if isinstance(exc, InitError) else ()
        raise InitError(f"{exc} -- the model was returned to the meta device; nothing is left uninitialized",
                        written) from exc
    return writer.report(time.perf_counter() - started)


def _retie(plan: ModelPlan) -> None:
    """Re-tie plain parameters that ``to_empty`` untied, restoring the model's sharing."""
    for tensor in plan.tensors:
        if tensor.new:
            continue
        first = tensor.tensor
        for module, attr in tensor.distinct_alias_tensors():
            if isinstance(first, torch.nn.Parameter) and type(first) is torch.nn.Parameter:
                setattr(module, attr, first)

