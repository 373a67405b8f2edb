"""Lightning keyed with one call: :class:`KeyedTraining`, a ``Callback`` for ``lightning.Trainer``; for Fabric, the same pieces.

``Trainer(callbacks=[KeyedTraining(seed)])`` and the user's LightningModule, DataModule and DataLoaders
as they are:

- **data order**: the training DataLoader the user returns (its dataset, ``batch_size``, ``collate_fn``,
  ``num_workers``, ...) is rebuilt over ``keyed_samples(dataset, data_seed)`` with a
  :class:`~keyinit.data.KeyedSampler` as its batch sampler: the global batch of optimizer step ``t`` has
  ``batch_size * accumulate_grad_batches * data-parallel size`` samples, the same for every world size;
  rank ``r`` takes its contiguous slice, cut into ``accumulate_grad_batches`` micro-batches of
  ``batch_size``. Lightning's ``DistributedSampler`` is not put in (the loader is a :class:`KeyedLoader`,
  an iterable over a DataLoader that Lightning leaves as it is);
- **collate**: the user's ``collate_fn`` wrapped in :func:`keyinit.data.keyed_collate` (its torch
  randomness, MLM masking included, keyed per sample; dynamic padding changes no value);
- **forward**: every ``training_step`` (its forwards and its backward) runs inside
  :func:`keyinit.nn.keyed` on the LightningModule with the batch's global sample positions, ``step`` the
  optimizer step (the sampler's: gradient accumulation's micro-batches share it);
- **init**: a model that ``configure_model`` builds on meta (``keyinit.deferred``, ``torch.device("meta")``,
  ``trainer.init_module(empty_init=True)``), sharded there or not (``ModelParallelStrategy``), is
  materialized by :func:`keyinit.materialize` right after the hook, each rank its own shards, before the
  strategy's ``reset_parameters`` would run; a model built eagerly is left as built;
- **resume**: the loader is stateful, so Lightning saves its state (the next optimizer step, the sampler's
  fingerprint) in the checkpoint with its loops; a checkpoint resumes at another world size (any that
  divides the global batch; ``accumulate_grad_batches`` may change with it: the loop's batch counters are
  converted);
- validation, test and prediction are untouched; nothing of keyinit stays on the module (its hooks live
  only inside each training step; the ``configure_model`` wrapper is removed once it has run).

Lightning has no public hook that replaces the training DataLoader or runs between ``configure_model``
and the strategy's setup: the callback swaps ``trainer.fit_loop._data_source`` (as Lightning's own
``BatchSizeFinder`` reads it) and wraps ``configure_model`` on the instance, from its ``setup`` hook,
and puts both back in ``teardown``. Fabric has no callback to hang this on: :func:`fabric_dataloader`
gives the keyed loader for a Fabric loop (its ``keyed(model)`` keys the batch just taken), and
:func:`keyed_parallelize` a ``parallelize_fn`` for Fabric's ``ModelParallelStrategy`` whose model is
materialized by keyinit. See ``docs/lightning.md``.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import keyinit
import keyinit.nn as knn
from keyinit.data import KeyedSampler, SamplePositions, keyed_collate, keyed_samples, sample_positions
from keyinit.keys import Key

__all__ = ["KeyedTraining", "KeyedLoader", "keyed_dataloader", "fabric_dataloader", "keyed_parallelize"]

#: DataLoader arguments carried over to the keyed loader as the user gave them.
_CARRIED = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator",
            "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order")


class _Recording:
    """A KeyedSampler's batch sampler that notes each index list's positions as the DataLoader takes it.

    The DataLoader hands its batches out in the order it took their indices (``in_order``), so the k-th
    batch out is the k-th position noted, whether its collate ran in a worker (whose bare tensors lose
    their attributes) or not."""

    def __init__(self, sampler: KeyedSampler, micro: int, noted: collections.deque) -> None:
        self._batches = sampler.batch_sampler(micro)
        self.sampler, self.micro_batch_size, self.noted = sampler, micro, noted

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[list]:
        for indices in self._batches:
            self.noted.append(sample_positions(indices))
            yield indices

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


class KeyedLoader:
    """A DataLoader over ``keyed_samples`` with a :class:`KeyedSampler` (see :func:`keyed_dataloader`).

    Iterating yields its batches; :attr:`positions` is the :class:`~keyinit.data.SamplePositions` of the
    batch yielded last and :meth:`take` those of the oldest batch not taken yet (Lightning's fetcher
    reads a batch ahead). :meth:`state_dict` is the step after the last micro-batch marked trained
    (:meth:`trained`; :meth:`keyed` marks its batch), not the sampler's, which a DataLoader's workers run
    ahead of; a new iteration starts there too (an iterator made before, and dropped, may have read ahead)."""

    def __init__(self, loader: DataLoader, sampler: KeyedSampler, micro_batch_size: int, seed: Union[int, Key],
                 noted: collections.deque) -> None:
        self.loader, self.sampler, self.micro_batch_size, self.seed = loader, sampler, micro_batch_size, seed
        self.batch_sampler = loader.batch_sampler  # (Lightning's set_epoch finds it here)
        self._noted = noted
        self._handed: collections.deque = collections.deque()
        self.positions: Optional[SamplePositions] = None
        self.next_step = sampler.step  # the first step not yet trained in full
        self.on_load: Optional[Callable[[dict], None]] = None

    @property
    def micro_batches(self) -> int:
        """Micro-batches of this rank a step (gradient accumulation)."""
        return self.sampler.local_batch_size // self.micro_batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self._noted.clear()
        self._handed.clear()
        if self.sampler.step != self.next_step:  # an iterator before this one read ahead (workers prefetch)
            self.sampler.load_state_dict(self.state_dict()["sampler"])
        return self._batches(iter(self.loader))

    def _batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.positions = self._noted.popleft()
            self._handed.append(self.positions)
            yield batch

    def take(self, batch: Any = None) -> SamplePositions:
        """The positions of the oldest batch yielded and not taken yet (``batch``'s own must agree)."""
        if not self._handed:
            raise RuntimeError("KeyedLoader.take: no batch was yielded that is not taken already")
        positions = self._handed.popleft()
        carried = sample_positions(batch) if batch is not None else None
        if carried is not None and carried != positions:
            raise RuntimeError(f"KeyedLoader.take: the batch carries {carried}, the loader yielded {positions} next")
        return positions

    def trained(self, positions: SamplePositions) -> None:
        """Mark the micro-batch at ``positions`` trained: the step is done after this rank's last one."""
        last = (self.sampler.rank + 1) * self.sampler.local_batch_size
        self.next_step = positions.step + 1 if positions.first + positions.rows == last else positions.step

    def keyed(self, model: torch.nn.Module, seed: Union[int, Key, None] = None, *,
              stream: Optional[str] = None) -> "knn.Keyed":
        """``keyinit.nn.keyed`` for the batch yielded last (a loop that takes each batch as it comes: Fabric's).

        A model ``fabric.setup`` returned is keyed as the module it wraps (``model.module``: the same FQNs
        on one process and under DDP/FSDP)."""
        if self.positions is None:
            raise RuntimeError("KeyedLoader.keyed: no batch was yielded yet")
        self._handed.clear()
        from lightning.fabric.wrappers import _FabricModule

        if isinstance(model, _FabricModule):
            model = model.module
        self.trained(self.positions)
        return knn.keyed(model, self.seed if seed is None else seed, step=self.positions.step,
                         samples=self.positions, stream=stream)

    def state_dict(self) -> dict:
        """``{"sampler": the sampler's state at the next untrained step, "micro_batches": ...}``."""
        state = self.sampler.state_dict()
        passes = self.sampler.num_steps or 1
        state.update(step=self.next_step, stop=(self.next_step // passes + 1) * passes)
        return {"sampler": state, "micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "sampler" not in state:
            raise ValueError(f"not a KeyedLoader state_dict (expected the key 'sampler'): {state!r}")
        self.sampler.load_state_dict(state["sampler"])
        self.next_step = self.sampler.step
        if self.on_load is not None:
            self.on_load(state)


def keyed_dataloader(loader: DataLoader, seed: Union[int, Key], *, rank: int = 0, world_size: int = 1,
                     accumulate: int = 1, start_step: int = 0) -> KeyedLoader:
    """``loader``'s dataset, ``batch_size`` (rows a forward), ``collate_fn`` and worker settings, keyed.

    The global batch is ``batch_size * accumulate * world_size`` samples; ``rank`` takes its slice of it,
    ``accumulate`` micro-batches of ``batch_size``. ``loader``'s sampler and ``shuffle`` are replaced by
    the keyed order (nothing is dropped or padded: an epoch is ``ceil(n / global batch)`` steps and the
    next one goes on where it ended); its ``collate_fn`` is wrapped in ``keyed_collate``."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"keyed_dataloader: expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
    if loader.batch_size is None:
        raise ValueError("keyed_dataloader: the DataLoader has a batch_sampler of its own and no batch_size; "
                         "give it batch_size= (rows a forward): keyinit's KeyedSampler makes the batches")
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        raise TypeError("keyed_dataloader: an IterableDataset has no sample indices to order; keyinit's data "
                        "order needs a map-style dataset (__getitem__ and __len__)")
    if not getattr(loader, "in_order", True):
        raise ValueError("keyed_dataloader: the DataLoader has in_order=False; keyed batches are handed out in "
                         "the order their indices were taken")
    micro = loader.batch_size
    sampler = KeyedSampler(len(loader.dataset), seed, global_batch_size=micro * accumulate * world_size,
                           rank=rank, world_size=world_size, start_step=start_step)
    noted: collections.deque = collections.deque()
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if kwargs.get("generator") is None:  # (a DataLoader iterator draws its workers' base seed from it: not the global RNG)
        kwargs["generator"] = torch.Generator()
    if not kwargs.get("num_workers"):
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    keyed = DataLoader(keyed_samples(loader.dataset, seed), batch_sampler=_Recording(sampler, micro, noted),
                       collate_fn=keyed_collate(loader.collate_fn, seed), **kwargs)
    return KeyedLoader(keyed, sampler, micro, seed, noted)


class _KeyedSource:
    """The fit loop's train-dataloader source, whose loader comes back keyed (see the module docstring)."""

    def __init__(self, source: Any, callback: "KeyedTraining", trainer: "pl.Trainer") -> None:
        self.source, self.callback, self.trainer = source, callback, trainer
        self.instance, self.name = source.instance, source.name

    def is_defined(self) -> bool:
        return self.source.is_defined()

    def is_module(self) -> bool:
        return self.source.is_module()

    def dataloader(self) -> Any:
        loader = self.source.dataloader()
        if not isinstance(loader, DataLoader):
            raise TypeError(f"KeyedTraining: train_dataloader returned a {type(loader).__name__}; keyinit keys one "
                            f"torch.utils.data.DataLoader (a map-style dataset with batch_size)")
        return self.callback._keyed_loader(self.trainer, loader)


class KeyedTraining(pl.Callback):
    """A ``lightning.Trainer`` callback: keyed init, data order, collate and forwards (module docstring).

    ``seed`` keys the forwards' randomness (dropout, attention dropout, ...) and the init of a model
    ``configure_model`` builds on meta; ``data_seed`` (default ``seed``) the data order and the
    samples' and collate function's randomness. ``stream``: :func:`keyinit.nn.keyed`'s (v2 by default).
    """

    def __init__(self, seed: Union[int, Key], *, data_seed: Union[int, Key, None] = None,
                 stream: Optional[str] = None) -> None:
        self.seed = seed
        self.data_seed = seed if data_seed is None else data_seed
        self.stream = stream
        self.loader: Optional[KeyedLoader] = None
        self._block: Optional[knn.Keyed] = None
        #: The :class:`~keyinit.data.SamplePositions` of the batch in training (None between training steps).
        self.positions: Optional[SamplePositions] = None
        self._source: Any = None
        self._configure: Any = None

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and not isinstance(trainer.fit_loop._data_source, _KeyedSource):
            self._source = trainer.fit_loop._data_source
            trainer.fit_loop._data_source = _KeyedSource(self._source, self, trainer)
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if is_overridden("configure_model", pl_module):
            self._wrap_configure_model(trainer, pl_module)

    def _wrap_configure_model(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        own = pl_module.configure_model
        seed = self.seed

        def configure_model() -> None:
            try:
                own()
            finally:
                self._unwrap(pl_module)  # once: nothing of keyinit stays on the module
            if any(t.is_meta for t in pl_module.parameters()) or any(t.is_meta for t in pl_module.buffers()):
                keyinit.materialize(pl_module, seed, device=trainer.strategy.root_device)

        vars(pl_module)["configure_model"] = self._configure = configure_model

    def _unwrap(self, pl_module: "pl.LightningModule") -> None:
        if self._configure is not None and vars(pl_module).get("configure_model") is self._configure:
            del vars(pl_module)["configure_model"]
        self._configure = None

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._close(None)
        self._unwrap(pl_module)
        if self._source is not None and isinstance(trainer.fit_loop._data_source, _KeyedSource):
            trainer.fit_loop._data_source = self._source
            self._source = None

    # ------------------------------------------------------------------ the loader
    def _keyed_loader(self, trainer: "pl.Trainer", loader: DataLoader) -> KeyedLoader:
        replicas = trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        self.loader = keyed_dataloader(loader, self.data_seed, rank=replicas["rank"],
                                       world_size=replicas["num_replicas"],
                                       accumulate=trainer.accumulate_grad_batches, start_step=trainer.global_step)
        self.loader.on_load = lambda state: self._converted(trainer, state)
        return self.loader

    def _converted(self, trainer: "pl.Trainer", state: dict) -> None:
        """A checkpoint saved with another ``accumulate_grad_batches``: the epoch loop's batch counters
        (which decide when the optimizer steps and when the epoch ends) counted in this run's micro-batches."""
        saved, now = int(state.get("micro_batches", 1)), self.loader.micro_batches
        if saved == now:
            return
        progress = trainer.fit_loop.epoch_loop.batch_progress
        for tracker in (progress.total, progress.current):
            processed = tracker.processed  # (saved in on_train_batch_end, ``completed`` is one behind it)
            if processed % saved:
                raise ValueError(f"KeyedTraining: the checkpoint was saved {processed} micro-batches into the run, "
                                 f"in the middle of an optimizer step of {saved} micro-batches; resume from a "
                                 f"checkpoint saved after an optimizer step")
            for name in ("ready", "started", "processed", "completed"):  # each as far from ``processed`` as it was
                setattr(tracker, name, processed // saved * now + getattr(tracker, name) - processed)

    # ------------------------------------------------------------------ the training step
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if self.loader is None:
            return
        self._close(None)
        if trainer.accumulate_grad_batches != self.loader.micro_batches:
            raise ValueError(f"KeyedTraining: accumulate_grad_batches is {trainer.accumulate_grad_batches}, the keyed "
                             f"loader was made for {self.loader.micro_batches} micro-batches a step; a global batch "
                             f"that changes during the run (GradientAccumulationScheduler) is not supported")
        self.positions = self.loader.take(batch)
        self._block = knn.keyed(pl_module, self.seed, step=self.positions.step, samples=self.positions,
                                stream=self.stream)
        self._block.__enter__()

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._close(None)
        if self.loader is not None and self.positions is not None:
            self.loader.trained(self.positions)
            self.positions = None

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._close(exception)

    def _close(self, exception: Optional[BaseException]) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.__exit__(type(exception) if exception else None, exception,
                           exception.__traceback__ if exception else None)


# ---------------------------------------------------------------------- Fabric
def fabric_dataloader(fabric: Any, loader: DataLoader, seed: Union[int, Key], *, accumulate: int = 1,
                      start_step: int = 0) -> KeyedLoader:
    """:func:`keyed_dataloader` for this Fabric process (its data-parallel rank and size), its batches
    moved to ``fabric.device``. Use it instead of ``fabric.setup_dataloaders``; around each forward and
    backward, ``with loader.keyed(model):`` keys the batch just taken."""
    strategy = fabric.strategy
    replicas = getattr(strategy, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
    keyed = keyed_dataloader(loader, seed, rank=replicas["rank"], world_size=replicas["num_replicas"],
                             accumulate=accumulate, start_step=start_step)
    if fabric.device.type != "cpu":
        keyed.loader = _ToDevice(keyed.loader, fabric)
    return keyed


class _ToDevice:
    """A DataLoader whose batches Fabric moves to its device."""

    def __init__(self, loader: DataLoader, fabric: Any) -> None:
        self.loader, self.fabric = loader, fabric
        self.batch_sampler = loader.batch_sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return (self.fabric.to_device(batch) for batch in self.loader)


def keyed_parallelize(parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module], seed: Union[int, Key], *,
                      device: Union[torch.device, str, None] = None) -> Callable[[torch.nn.Module, Any], torch.nn.Module]:
    """A ``parallelize_fn`` for Fabric's ``ModelParallelStrategy``: ``parallelize(model, device_mesh)``, then
    :func:`keyinit.materialize` of a model left on meta (each rank its own shards, no communication),
    before Fabric's ``reset_parameters`` would run."""

    def parallelized(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        model = parallelize(model, device_mesh)
        if any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers()):
            target = device if device is not None else device_mesh.device_type
            keyinit.materialize(model, seed, device=target)
        return model

    return parallelized
