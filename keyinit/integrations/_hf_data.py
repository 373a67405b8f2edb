"""A Hugging Face ``Trainer``'s train DataLoader rebuilt over keyinit's data: ``KeyedSampler``,
``keyed_samples`` and ``keyed_collate``, from the Trainer's own arguments.

The global batch of an optimizer step is ``per_device_train_batch_size * gradient_accumulation_steps *
world size`` (the Trainer's ``get_total_train_batch_size``); rank ``r`` takes its contiguous slice of it and
cuts it into micro-batches of ``per_device_train_batch_size`` rows, one per forward. Each collated batch
carries its step and its rows' places in the global batch (``keyinit.data.sample_positions``).

accelerate's ``prepare`` is kept (its epoch and gradient-state bookkeeping), but not its device placement
(``training_step`` moves the batch, once it has read the batch's positions), and the
``BatchSamplerShard`` it puts round a batch sampler on several processes is made a pass-through, as the
Trainer does for its own rank-aware ``BatchRebalanceSampler``: the keyed batch sampler already yields this
rank's batches only.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader

from keyinit.data import KeyedSampler, keyed_collate, keyed_samples

__all__ = ["keyed_train_dataloader"]


def _refuse(what: str) -> None:
    raise ValueError(f"keyinit.integrations.transformers: {what}")


def _data_parallel(trainer: Any) -> tuple[int, int]:
    """``(rank, world size)`` of data parallelism: tensor, context and sequence parallel ranks are refused."""
    args = trainer.args
    shared = trainer.get_tp_size() * trainer.get_cp_size() * trainer.get_sp_size()
    if shared != 1:
        _refuse(f"tensor/context/sequence parallelism (tp * cp * sp = {shared}) shares a batch between ranks; "
                f"the keyed train DataLoader supports data parallelism (DDP, FSDP) only")
    return args.process_index, max(1, args.world_size)


def keyed_train_dataloader(trainer: Any, data_seed: int) -> tuple[DataLoader, KeyedSampler]:
    """The train DataLoader of ``trainer`` (a ``transformers.Trainer``) over keyinit's sampler and collate,
    prepared by its accelerator; and the sampler."""
    import transformers.trainer as hf

    args = trainer.args
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hf.has_length(dataset):
        _refuse(f"the train_dataset ({type(dataset).__name__}) has no length or is an IterableDataset; "
                f"KeyedSampler indexes a map-style dataset (len() and dataset[i])")
    if args.train_sampling_strategy not in ("random", "sequential"):
        _refuse(f"train_sampling_strategy={args.train_sampling_strategy!r}: keyinit's KeyedSampler gives the data "
                f"order ('random' shuffles it, 'sequential' keeps it); group_by_length and batch_rebalance batch by "
                f"length per process, which is not one global batch per step")
    collator = trainer.data_collator
    if hf.is_datasets_available() and isinstance(dataset, hf.datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="Training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="Training")
    rank, world = _data_parallel(trainer)
    micro = trainer._train_batch_size  # per_device_train_batch_size (times the GPUs of DataParallel)
    sampler = KeyedSampler(len(dataset), data_seed, global_batch_size=trainer.get_total_train_batch_size(args),
                           rank=rank, world_size=world, shuffle=args.train_sampling_strategy == "random")
    batches = sampler.batch_sampler(micro)
    params: dict[str, Any] = {
        "batch_sampler": batches,
        "collate_fn": keyed_collate(collator, data_seed),
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "multiprocessing_context": args.dataloader_multiprocessing_context,
        "prefetch_factor": args.dataloader_prefetch_factor,
        "in_order": args.dataloader_in_order,
        "worker_init_fn": partial(hf.seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
    }
    loader = trainer.accelerator.prepare(DataLoader(keyed_samples(dataset, data_seed), **params))
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

    if isinstance(loader, DataLoaderDispatcher):
        _refuse("accelerate's dispatch_batches=True collates on process 0 and splits the batch; the keyed "
                "DataLoader gives each rank its own slice of the global batch (leave dispatch_batches unset)")
    shard = getattr(loader, "batch_sampler", None)
    if isinstance(shard, BatchSamplerShard) and shard.batch_sampler is batches:
        shard.num_processes, shard.process_index = 1, 0  # already this rank's batches: pass them through
    elif shard is not batches:
        _refuse(f"accelerate wrapped the keyed batch sampler in an unexpected {type(shard).__name__}")
    # accelerate moves a batch to the device by rebuilding a dict (type(batch)({...})), which drops the positions
    # a collated dict carries: the Trainer's training_step moves it (_prepare_inputs) after they are read
    if getattr(loader, "device", None) is not None:
        loader.device = None
    return loader, sampler
