"""The pieces of a keyed block: root forwards, named blocks, and checkpoint recomputes.

- :class:`Forward`: one root forward (an outermost module execution): the rows it
  holds (``start``, ``count``), its repeat count, its tensors' batch records
  (:mod:`keyinit.nn._batch.records`), the keys of its calls and of its host generators
  (:mod:`keyinit.nn._forward.hostrandom`: how they are keyed, and what is refused);
- :func:`remember` / :func:`recomputed`: how a forward that activation
  checkpointing recomputes in backward finds its first execution (non-reentrant:
  the same input tensors; reentrant: the memory of the detached inputs);
- :class:`CheckpointingFunction`: transformers' gradient checkpointing, whose recompute bypasses
  the module's hooks;
- :class:`Named` (``keyed("a.name", ...)``).

The context that uses them is :mod:`keyinit.nn._context.keyed`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch

from keyinit.keys import Key, as_uint64
from keyinit.nn._batch.records import annotate, record
from keyinit.nn._forward.hostrandom import SAMPLE_FIXES, HostRandom, fold, host_stream_folds
from keyinit.nn._ops.keys import CallKeys

__all__ = ["Forward", "Named", "CheckpointingFunction", "input_tensors", "sequence_first_module",
           "sequence_first_dropouts", "resolve_sample_offset", "remember", "remember_host", "remember_counts",
           "recompute_counts", "recomputed", "CALLS_RULES"]

#: The values of ``keyed(..., calls=...)``: how a module's call ordinals are numbered (docs/spec.md 14.4).
CALLS_RULES = ("forward", "execution")


class Forward:
    """One root forward: an outermost module execution in a keyed block, and the rows it holds.

    ``start`` is the global sample of its inputs' row 0 (``sample_offset`` plus the
    micro-batch's offset); ``repeat`` counts the earlier root forwards of the same
    module in the block whose rows overlap these (a double forward, R-Drop), and
    is folded into every key of this forward when it is not 0.
    """

    __slots__ = ("start", "count", "repeat", "fqn", "constants", "owner", "grad", "drew", "records", "probe", "escaped",
                 "host", "host_states", "counts", "counts_at", "keys", "__weakref__")

    def __init__(self, ctx: Any, fqn: str, start: int, count: int, repeat: int) -> None:
        self.fqn, self.start, self.count, self.repeat = fqn, start, count, repeat
        self.constants = ctx.constants  # ids of the model's buffers: replicated unless computed otherwise
        self.owner = weakref.ref(ctx)
        self.grad = torch.is_grad_enabled()  # autograd on at the start (off inside: reentrant checkpointing)
        self.drew = False  # a keyed draw was made: later forwards of these rows are repeats
        self.records: dict[int, tuple[Any, Any]] = {}  # id(tensor) -> (weakref, its batch record): _batch/records.py
        # a shape probe (meta tensors, a pipeline stage's shape inference): later forwards do not repeat it
        self.probe = False
        # batch sizes len() turned into plain ints (keyinit.nn._forward.modes): a factory sized by one is not placed. In
        # a forward of one row every plain 1 may be the batch size (a record of one sample may sit in another
        # dimension than a larger batch's, and x.shape[0] is then a plain 1): a draw sized by it is refused
        # rather than drawn replicated
        self.escaped: set[int] = {1} if count == 1 else set()
        self.host: Optional[HostRandom] = None  # its running execution's host generators (hostrandom.py)
        # the host generators' states where a module under activation checkpointing began (remember_host):
        # _replay_key of its first input -> HostRandom.state(), or None where they were as seeded
        self.host_states: dict[tuple, Any] = {}
        # the call ordinals its modules have taken (FQN -> count; keyed(..., calls="forward"): shared by
        # every frame of the forward), and where they stood as a module under activation checkpointing
        # began (_replay_key of its first input -> a copy, or AMBIGUOUS): its recompute numbers from there
        self.counts: dict[str, int] = {}
        self.counts_at: dict[tuple, Any] = {}
        self.keys: Optional[CallKeys] = None  # its calls' keys (made on the first, for the context's root and step)

    def host_key(self, ctx: Any) -> Key:
        """The key that seeds Python's and numpy's generators in this forward (docs/spec.md 14.7):
        ``keyed_module_key(root, step, fqn)`` folded with ``"host"``, its repeat (if any) and
        :func:`~keyinit.nn._forward.hostrandom.host_stream_folds`."""
        data: tuple = ("host", self.repeat) if self.repeat else ("host",)
        return self.call_keys(ctx).below(self.fqn, data + host_stream_folds(self.start, self.count, ctx.host_mode))

    def call_keys(self, ctx: Any) -> CallKeys:
        """The keys of this forward's calls under ``ctx``'s root and step (made once)."""
        keys = self.keys
        if keys is None or keys.root is not ctx.root or keys.step != ctx.step:
            keys = self.keys = CallKeys(ctx.root, ctx.step)
        return keys

    def host_random(self, ctx: Any, fqn: str, args: tuple = (), kwargs: Optional[dict] = None,
                    resumed: Optional[tuple] = None) -> HostRandom:
        """Python's and numpy's generators keyed for this forward's execution of ``fqn`` (its root module,
        or a module that activation checkpointing recomputes: from the states its first execution began
        with; ``resumed``: ``(states,)`` where a ``keyinit.nn.checkpoint`` region began, None for as seeded),
        with what is refused there."""
        model = ctx.model
        if getattr(type(model), "_keyinit_block", False):
            where = f"keyed block '{model.name}'"
        else:
            where = f"keyed({type(model).__name__}): the forward of " + (f"module '{self.fqn}'" if self.fqn else
                                                                          "the root module")
        refuse, resume = None, None
        replay = _host_replay_key(fqn, args, kwargs or {}) if fqn != self.fqn and resumed is None else None
        if ctx.index != "tracked":
            refuse = (f"{where} (index='dim0') drew from ", "'s global state: index='dim0' keys only the dropout "
                      "family, and refuses every other draw rather than reading a global generator. Use "
                      "keyinit.nn.keyed(..., index='tracked') (the default) to key random and numpy.random")
        elif resumed is not None:
            resume = resumed[0]
        elif fqn != self.fqn and replay in self.host_states:
            resume = self.host_states[replay]  # None: it began with the generators as seeded
        elif fqn != self.fqn:
            refuse = (f"{where}: activation checkpointing recomputed module '{fqn}' in backward, which drew from ",
                      "'s global state. A recompute of a module inside the keyed forward starts the generator from "
                      "the forward's seed, not where its first execution drew, so its values (and the gradients) "
                      "would differ: checkpoint the whole keyed model (its recompute replays the forward's host "
                      "stream), or draw with torch ops, which keyed() keys in recomputes")
        elif self.count > 1 and ctx.host_mode == "sample":
            last = self.start + self.count - 1
            refuse = (f"{where} over samples {self.start}..{last} ({self.count} rows) drew from ", SAMPLE_FIXES)
        self.host = HostRandom(self.host_key(ctx), refuse, lambda: self.mark_drawn(ctx), resume)
        return self.host

    def mark_drawn(self, ctx: Any) -> None:
        """This forward drew keyed values (a random op, or a host generator): a later forward of these rows is
        a repeat."""
        if not self.drew and not self.probe:
            self.drew = True
            ctx.drew_rows(self.fqn, self.start, self.start + self.count)

    def call_key(self, ctx: Any, fqn: str, ordinal: int) -> Key:
        if not self.drew:
            self.mark_drawn(ctx)
        k = self.call_keys(ctx)(fqn, ordinal)
        if self.repeat:
            k = fold(fold(k, "repeat"), self.repeat)
        return k


def sequence_first_module(module: torch.nn.Module) -> bool:
    """torch's transformer modules built sequence-first (``batch_first=False``, torch's default)."""
    nn = torch.nn
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    if isinstance(module, nn.MultiheadAttention):
        return not module.batch_first
    if isinstance(module, nn.Transformer):
        return not module.batch_first
    if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and len(module.layers):
        return sequence_first_module(module.layers[0])
    return False


def _pure_leaf_types() -> frozenset:
    """torch.nn's layers whose forward draws nothing and calls no submodule (``RReLU``, ``FractionalMaxPool``,
    dropout, attention and recurrent layers are not among them)."""
    nn = torch.nn
    names = (
        "Linear", "Bilinear", "Identity", "Embedding", "EmbeddingBag", "LayerNorm", "RMSNorm", "GroupNorm",
        "LocalResponseNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d",
        "InstanceNorm3d", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
        "Flatten", "Unflatten", "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid", "Softmax", "LogSoftmax",
        "Softplus", "LeakyReLU", "ELU", "SELU", "CELU", "GLU", "Hardtanh", "Hardswish", "Hardsigmoid", "PReLU",
        "Softsign", "Tanhshrink", "Threshold", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d",
        "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
        "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "PixelShuffle", "PixelUnshuffle", "ZeroPad1d", "ZeroPad2d",
        "ConstantPad1d", "ConstantPad2d",
    )
    return frozenset(getattr(nn, name) for name in names if hasattr(nn, name))


_PURE_LEAVES: dict = {}  # "types": _pure_leaf_types(), built on first use


def pure_leaf(module: torch.nn.Module) -> bool:
    """``module`` is one of torch.nn's layers that draw nothing (exactly that class, its own ``forward``, no
    submodule): keyed() opens no frame for its executions inside a running forward (nothing in them is named
    by it), and hooks it only where torch's checkpoint_sequential may begin a recompute with it."""
    types = _PURE_LEAVES.get("types")
    if types is None:
        types = _PURE_LEAVES["types"] = _pure_leaf_types()
    kind = type(module)
    if kind not in types or module._modules or "forward" in module.__dict__:
        return False
    return getattr(kind.forward, "__module__", "").startswith("torch.nn.modules.")  # (not patched on the class)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def resolve_sample_offset(model: torch.nn.Module, sample_offset: Optional[int]) -> int:
    """The rule: explicit under more than one process; never 0 on a DDP rank other than 0."""
    if sample_offset is None:
        world = _world()
        if world > 1:
            raise ValueError(
                f"keyed: torch.distributed is initialized with {world} ranks, so sample_offset must be given: the "
                "global index of this rank's first sample in the step's batch (e.g. dp_rank * local_batch + "
                "micro-batch offset), or 0 where every rank holds the whole batch (tensor/sequence parallelism; "
                "DTensor activations add their own placements)"
            )
        return 0
    offset = as_uint64(sample_offset, "sample_offset")
    if offset == 0 and _world() > 1:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            import torch.distributed as dist

            rank = dist.get_rank(model.process_group)
            if rank > 0:
                raise ValueError(
                    f"keyed: sample_offset=0 on rank {rank} of the DistributedDataParallel group: each data-parallel "
                    "rank holds its own rows of the batch, so its first sample is not global sample 0; pass "
                    "sample_offset = rank * local_batch (+ the micro-batch offset)"
                )
    return offset


def sequence_first_dropouts(modules: Iterable[torch.nn.Module]) -> frozenset[int]:
    """The dropout modules of torch's sequence-first (``batch_first=False``, torch's default)
    ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` among ``modules`` (a model's): their
    activations are ``(sequence, batch, features)``, so dimension 1, not 0, is the batch."""
    layers = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
    found = set()
    for module in modules:
        if isinstance(module, layers) and not getattr(module.self_attn, "batch_first", True):
            found.update(id(child) for child in module.children() if isinstance(child, torch.nn.Dropout))
    return frozenset(found)


def input_tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _visit(args, 0, found)
    _visit(kwargs, 0, found)
    return found


def _visit(value: Any, depth: int, found: list) -> None:
    # (a module-level function: a nested recursive one is a reference cycle, left to the garbage collector)
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 2 and isinstance(value, (list, tuple)):
        for v in value:
            _visit(v, depth + 1, found)
    elif depth < 2 and isinstance(value, dict):
        for v in value.values():
            _visit(v, depth + 1, found)


def _replay_key(fqn: str, t: torch.Tensor) -> tuple:
    return (fqn, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

def remember(ctx: Any, fqn: str, forward: "Forward", args: tuple, kwargs: dict) -> None:
    """A module run with autograd off inside a forward that had it on (reentrant activation
    checkpointing): its input tensors are remembered, for the recompute in backward to find this
    forward and their batch records (and the host generators' states, :func:`remember_host`)."""
    for t in input_tensors(args, kwargs):
        ctx.remember_replay(_replay_key(fqn, t), t, forward)
    remember_host(fqn, forward, args, kwargs)


def _host_replay_key(fqn: str, args: tuple, kwargs: dict) -> Optional[tuple]:
    tensors = input_tensors(args, kwargs)
    return _replay_key(fqn, tensors[0]) if tensors else None


#: A ``Forward.counts_at`` entry for a module run twice under activation checkpointing on the same input
#: memory with different counts before it: which one a recompute is cannot be told.
AMBIGUOUS = object()


def remember_counts(fqn: str, forward: "Forward", counts: dict, args: tuple, kwargs: dict) -> None:
    """A module run under activation checkpointing inside ``forward``: the call ordinals taken before it
    began, for its recompute in backward to number its calls (and its children's) as its first execution did
    (found by its first input's memory, as the host generators' states are)."""
    replay = _host_replay_key(fqn, args, kwargs)
    if replay is None:
        return
    seen = forward.counts_at.get(replay)
    snapshot = dict(counts)
    if seen is not None and seen is not AMBIGUOUS and _subtree(seen, fqn) != _subtree(snapshot, fqn):
        snapshot = AMBIGUOUS
    forward.counts_at[replay] = snapshot


def _subtree(counts: dict, fqn: str) -> dict:
    prefix = fqn + "." if fqn else ""
    return {k: v for k, v in counts.items() if k == fqn or k.startswith(prefix)}


def recompute_counts(ctx: Any, forward: "Forward", fqn: str, args: tuple, kwargs: dict) -> dict:
    """The counts a recompute of module ``fqn`` in ``forward`` starts from (see :func:`remember_counts`)."""
    if fqn == forward.fqn:
        return {}  # the whole root forward: numbered from the start
    found = forward.counts_at.get(_host_replay_key(fqn, args, kwargs))
    if found is AMBIGUOUS:
        from keyinit.errors import UnkeyedRandomnessError

        raise UnkeyedRandomnessError(
            f"keyed({type(ctx.model).__name__}): activation checkpointing recomputes module '{fqn}', which ran "
            "more than once in the forward on the same input memory with different call counts before it, so "
            "keyinit cannot tell which execution this recompute is (its keys would be a guess). Checkpoint the "
            "enclosing module instead, or pass a fresh tensor to each execution"
        )
    return dict(found) if found is not None else {}


def remember_host(fqn: str, forward: "Forward", args: tuple, kwargs: dict) -> None:
    """A module run under activation checkpointing inside ``forward``: where the host generators stand
    as it begins, for a recompute that starts at this module to draw what it drew (found by its first
    input's memory, as reentrant checkpointing's are)."""
    host = forward.host
    if host is None or not forward.grad:
        return
    replay = _host_replay_key(fqn, args, kwargs)
    if replay is not None:
        forward.host_states[replay] = host.state() if host.moved() else None

def recomputed(ctx: Any, fqn: str, args: tuple, kwargs: dict) -> Optional["Forward"]:
    """The forward whose execution of module ``fqn`` a forward run in backward recomputes, or None."""
    tensors = input_tensors(args, kwargs)
    for t in tensors:  # non-reentrant checkpointing: the very input tensors of the first execution
        holders = [forward for forward in ctx.forwards
                   if (entry := forward.records.get(id(t))) is not None and entry[0]() is t]
        if holders:  # the root forward of this module itself, else the one it ran inside
            return next((f for f in holders if f.fqn == fqn), holders[0])
    found_forward = None
    for t in tensors:  # reentrant checkpointing: detached copies of the inputs, the same memory
        found = ctx.replayed(_replay_key(fqn, t))
        original = None if found is None else found[0]
        if original is not None:
            found_forward = found[1]
            annotate(t, found_forward, record(original, found_forward))
    return found_forward

class CheckpointingFunction:
    """transformers' gradient checkpointing of ``module`` (its ``_gradient_checkpointing_func``), keyed.

    ``GradientCheckpointingLayer`` checkpoints ``partial(forward, module)``, the module's forward without its
    call: the recompute in backward runs the module's own code outside its hooks, so keyinit would not key
    the draws it makes directly (``F.dropout`` in BART's layers: torch's mask, wrong gradients) nor find its
    children's inputs (tensors the recompute makes anew). While the block (and its recomputes) lasts, the
    module's ``_gradient_checkpointing_func`` is this wrapper: the recompute runs as the module's execution
    again (:func:`recomputed`: the first execution's forward, a frame with its call counter from 0, the
    host generators where they stood), with each recomputed input given its first execution's batch record.
    :meth:`remove` puts the function back.
    """

    def __init__(self, ctx: Any, module: torch.nn.Module) -> None:
        self.ctx, self.module = ctx, module
        self.original = module.__dict__["_gradient_checkpointing_func"]
        module._gradient_checkpointing_func = self

    def remove(self) -> None:
        if self.module.__dict__.get("_gradient_checkpointing_func") is self:
            self.module._gradient_checkpointing_func = self.original

    def __call__(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = self.ctx
        frame = ctx.current_frame()
        if frame is None or frame.foreign or frame.module is not self.module:
            return self.original(fn, *args, **kwargs)
        forward, module, fqn = frame.forward, frame.module, frame.fqn
        remember_host(fqn, forward, args, {})
        firsts = args

        def run(*inputs: Any) -> Any:
            if torch._C._current_graph_task_id() == -1:
                return fn(*inputs)  # the first execution: inside the module's own frame already
            for new, old in zip(inputs, firsts):  # reentrant checkpointing passes detached copies
                if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new is not old:
                    annotate(new, forward, record(old, forward))
            with ctx.recomputing():  # (after the block: the context's hooks on the model for the recompute only)
                ctx.enter_execution(module, fqn, inputs)
                try:
                    out = fn(*inputs)
                except BaseException:
                    ctx.leave_execution(module, inputs, None)  # (an early stop of non-reentrant checkpointing)
                    raise
                ctx.leave_execution(module, inputs, out)
            return out

        run.keyed_recompute = True  # type: ignore[attr-defined]  # (no draw in it is unseen: keyinit._checkpoint)
        return self.original(run, *args, **kwargs)


class Named(torch.nn.Module):
    """The stand-in module of a named block (``keyed("name", ...)``): its FQN is the name."""

    _keyinit_block = True

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

