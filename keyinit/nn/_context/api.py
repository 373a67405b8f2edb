"""The entry points of keyed forwards: ``keyinit.nn.keyed(model, seed, step=...)`` (the context,
:class:`keyinit.nn._context.keyed.Keyed`) and ``keyinit.nn.batch_dim(tensor, dim)`` (where a tensor's batch is)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from keyinit.nn._batch.records import Batch, annotate, declare
from keyinit.keys import Key, as_uint64
from keyinit.nn._recompute.checkpoint import Region
from keyinit.nn._context.keyed import Keyed, current_forward, running_frame
from keyinit.nn.policy import Randomness, resolve

__all__ = ["keyed", "batch_dim", "checkpoint"]


def batch_dim(tensor: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    """Declare where ``tensor``'s batch is for :func:`keyinit.nn.keyed`; returns ``tensor``.

    Before the forward (a model input): ``dim`` is the dimension that indexes the
    samples (``0`` is the default for every input whose dimension 0 has the batch's
    size), or ``None`` for an input that holds no batch (replicated: the same for
    every sample, e.g. a position table). Inside a keyed forward: the tensor's
    dimension ``dim`` holds the samples of the running forward, in order.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"batch_dim: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"batch_dim: dim must be None or a dimension of the {tensor.dim()}-D tensor, got {dim!r}")
        dim %= tensor.dim()
    declare(tensor, dim)
    forward = current_forward()
    if forward is not None:
        record = None if dim is None else Batch(dim, int(tensor.shape[dim]), forward.start)
        annotate(tensor, forward, record)
    return tensor


def keyed(model: Union[torch.nn.Module, str], seed: Union[int, Key], *, step: int,
          sample_offset: Optional[int] = None, samples: Any = None, randomness: Optional[Randomness] = None,
          inputs: Any = (), stream: Optional[str] = None, index: Optional[str] = None,
          host_random: Optional[str] = None, calls: Optional[str] = None) -> Keyed:
    """Key every random op in ``model``'s forward by (seed, step, module FQN, call ordinal, sample, place).

    Use it around each forward (and backward)::

        with keyinit.nn.keyed(model, seed, step=step, sample_offset=first_sample):
            loss = loss_fn(model(batch), target)
            loss.backward()

    Inside, the ``n``-th random call made directly by the module with canonical FQN
    ``fqn`` (``keyinit.fqn.canonical_modules``: wrappers such as ``_orig_mod``,
    ``_checkpoint_wrapped_module`` and DDP's ``module`` are stripped) in the root
    forward, counted across the module's executions (a module run twice goes on
    numbering, so its executions never share a key), uses
    ``dropout_key(seed, step=step, fqn=fqn, ordinal=n)``: the dropout family
    (``nn.Dropout``, ``F.dropout*``, alpha dropout), attention dropout (SDPA,
    ``nn.MultiheadAttention``) and every other random ATen op (``rand``,
    ``bernoulli_``, ``normal_``, ``exponential_``, ...; ``docs/spec.md`` 14.7).
    Each element is indexed by its global sample and its place within that
    sample, tracked from the model's inputs through every op
    (:mod:`keyinit.nn._batch.records`; ``docs/spec.md`` 14.6): the inputs' dimension 0 is
    the batch, local row ``r`` global sample ``sample_offset + r``. So splitting a
    batch across data-parallel ranks, micro-batches (``ctx.micro_batch(offset)``,
    :func:`micro_batches` for pipelining schedules) or gradient-accumulation steps
    never changes a value, nor does flattening the batch with heads or tokens.
    A draw whose samples cannot be placed raises
    :class:`keyinit.errors.UnkeyedRandomnessError` naming the module, the op and
    why; :func:`keyinit.nn.batch_dim` declares a tensor's batch.

    Python's ``random`` and ``numpy.random`` are seeded per root forward and
    restored after it; ``randomness=Randomness(host=...)`` (``"sample"``, ``"rows"``,
    ``"replicated"``) says from what, and whether a forward of several samples
    may draw from them (:mod:`keyinit.nn._forward.hostrandom`, ``docs/spec.md`` 14.7).
    Randomness outside the model's forwards is left alone; the global RNGs are
    never read or advanced. ``Randomness(index="dim0")`` keeps stream v1's first rule
    (dimension 0 of each dropout input is the batch; other draws refused; calls
    numbered per execution). ``Randomness(calls="execution")`` keeps that rule's numbering
    alone: the count restarts at each execution of a module, so two executions of
    one module in a forward share their keys (``docs/spec.md`` 14.4).
    :class:`keyinit.nn.Randomness` (:mod:`keyinit.nn.policy`) holds the three choices;
    the keywords ``index=``, ``calls=`` and ``host_random=`` (``"forward"`` for
    ``host="rows"``) still work, with a ``DeprecationWarning`` naming the new spelling.

    ``model`` may also be a name (``"diffusion.noise"``): the whole block is then
    one root forward under that FQN, whose batch-holding tensors are ``inputs``
    (randomness of a training loop: ``torch.randn_like(latents)``,
    ``torch.randint(0, T, (latents.shape[0],))``).

    ``seed`` is an int in ``[0, 2**64)`` or a :class:`keyinit.Key` (the root of
    every key, as for :func:`dropout_key`); ``step`` and ``sample_offset`` are ints
    in ``[0, 2**64)``. ``sample_offset`` defaults to 0 in a single process. When
    ``torch.distributed`` is initialized with more than one rank it must be given
    (a ``ValueError`` otherwise): keyinit cannot tell data-parallel ranks (each
    with its own rows) from tensor-parallel ones (all with the whole batch). A
    model wrapped in ``DistributedDataParallel`` on a group rank other than 0
    refuses ``sample_offset=0``. DTensor activations place their rows themselves
    (their placements add to ``sample_offset``).

    ``stream`` chooses how an element is named (``docs/spec.md`` 14.8): ``"v2"`` by its sample and its
    coordinates within the sample, so a sample's masks do not depend on how far its batch is padded
    (dynamic padding) or on any other extent; ``"v1"`` by its row-major index in the tensor of samples
    (14.4-14.7), which depends on the padded length: the masks of blocks keyed before v2 was the default,
    bit for bit. ``None`` (the default) is ``"v2"``, whatever the version of a :class:`keyinit.Key` given
    as ``seed`` (``keyed(m, 7)`` and ``keyed(m, keyinit.key(7))`` are the same block). Keys are derived
    the same way in both.

    ``samples`` instead of ``sample_offset``: the (micro-)batch the forward runs on, as
    keyinit.data made it, which says where its rows sit in the run (a
    :class:`keyinit.data.SamplePositions`, or an object that carries one as
    ``.keyinit_samples``: the collated batch of a DataLoader over
    ``keyed_samples(dataset, seed)`` with ``batch_sampler=KeyedSampler.batch_sampler(...)``
    and ``collate_fn=keyed_collate(...)``, its :class:`keyinit.data.KeyedBatch`, or the
    indices the batch sampler yielded). ``sample_offset`` is then the batch's first
    row's place in the step's global batch, so data-parallel ranks, micro-batches and
    gradient accumulation need no arithmetic. Its step must be ``step`` (a
    ``ValueError`` otherwise: the batch belongs to another step); giving both
    ``samples`` and ``sample_offset``, or a ``samples`` that carries no positions,
    is an error (``ValueError``, ``TypeError``), and so is a root forward whose rows are not the
    batch's (a batch flattened or packed into fewer rows; rows cut from it outside
    ``ctx.micro_batch``). A ``samples`` whose ``attention_mask`` has padding before a real token
    (left padding) gets a :class:`keyinit.errors.LeftPaddingWarning`:
    elements are named by their coordinates, not by the token's position, so pad on the right
    (``docs/dropout.md``, "Padding and packing").
    """
    index, calls, host_random = resolve(randomness, index=index, calls=calls, host_random=host_random)
    positions = None if samples is None else _positions_of(samples, sample_offset, step)
    ctx = Keyed(model, seed, step, sample_offset if positions is None else positions.first, index, inputs,
                host_random, calls, stream)
    if positions is not None:
        ctx.sample_rows = positions.rows
    return ctx


def _positions_of(samples: Any, sample_offset: Optional[int], step: int) -> Any:
    """``keyed(samples=)``: where the batch's rows sit in the step's global batch (see :func:`keyed`)."""
    from keyinit._samples.padding import check_samples
    from keyinit._samples.positions import sample_positions

    if sample_offset is not None:
        raise ValueError("keyed: give samples= or sample_offset=, not both (samples= says the batch's first "
                         "sample; sample_offset= is that number given by hand)")
    positions = sample_positions(samples)
    if positions is None:
        raise TypeError(
            f"keyed: samples= got a {type(samples).__name__} that carries no sample positions; expected the batch "
            f"a DataLoader made over keyinit.data.keyed_samples(dataset, seed) with "
            f"batch_sampler=KeyedSampler.batch_sampler(...) and collate_fn=keyinit.data.keyed_collate(...) (the "
            f"object it yielded, not a new dict made from it), its KeyedBatch, or a keyinit.data.SamplePositions; "
            f"or pass sample_offset= instead"
            + (" (a bare tensor that a collate function returned loses them in DataLoader worker processes: "
               "return a tuple, list or dict)" if isinstance(samples, torch.Tensor) else ""))
    step = as_uint64(step, "step")
    if positions.step != step:
        raise ValueError(f"keyed: samples= holds rows of step {positions.step} (KeyedSampler's step), but "
                         f"step={step}: the sampler's steps must be the optimizer's (global_batch_size = all the "
                         f"samples of one optimizer step, micro-batches by batch_sampler(micro_batch_size=...))")
    check_samples(samples)  # a left-padded attention_mask: a LeftPaddingWarning (keyinit._samples.padding)
    return positions


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, **kwargs)`` whose recompute keyed() keys as the
    first execution.

    Inside a keyed forward, backward recomputes ``function`` with the keys it drew with: its own draws
    (``torch.rand_like(y)``, ``F.dropout(y, p)`` written in the function), the modules it calls on tensors it
    computed, and Python's and numpy's generators, each where the first execution left them; reentrant or not
    (``use_reentrant`` is passed on, as every other argument), with ``backward()`` inside the keyed block or
    after it. Outside a keyed forward it is torch's checkpoint. torch's own checkpoint of a module
    (``checkpoint(module, x)``) is keyed as well; of a function, a draw in it is refused
    (``UnkeyedRandomnessError``) because its recompute would not be seen.
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    found = running_frame()
    if found is not None and not found[1].foreign:
        function = Region(found[0], found[1], function, args)
    return torch_checkpoint(function, *args, **kwargs)
