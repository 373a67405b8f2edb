"""torchtitan's train loop keyed by keyinit without forking torchtitan: the recipe's code.

docs/torchtitan.md explains it; tests/zoo/test_torchtitan.py checks it on torchtitan 0.3.0's
llama3 ``debugmodel``. Two pieces, both plugged in through a ``Trainer.Config`` the user
already writes (a config function such as torchtitan's ``llama3_debugmodel()``):

- :func:`keyed_model_spec`: the model spec with its ``parallelize_fn`` wrapped, so that the
  model torchtitan builds on meta and parallelizes gets an ``init_weights`` that is
  ``keyinit.init_model`` replaying torchtitan's own ``init_states`` keyed. torchtitan's
  Trainer calls ``model.to_empty(device)`` and then ``model.init_weights(buffer_device=...)``
  (per pipeline stage too): both unchanged, every value a pure function of (seed, FQN,
  global index), the same under every FSDP2/TP layout, with no collective.
- :class:`KeyedDataLoader`: a torchtitan dataloader (``Trainer.Config.dataloader``) over a
  map-style dataset, its order from :class:`keyinit.data.KeyedSampler`. A micro-step of every
  dp rank together takes the next ``local_batch_size * dp_world_size`` global positions, rank
  ``r`` the ``r``-th contiguous slice, so an optimizer step of global batch ``G`` takes
  positions ``[t*G, (t+1)*G)`` whatever the dp degree and the gradient accumulation. Its
  checkpoint state is the next global position, so a run resumes at another dp degree.

Importing this module imports torchtitan (its dataloader base class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from torchtitan.components.dataloader import BaseDataLoader

import keyinit
from keyinit.data import KeyedSampler

__all__ = ["keyed_init_weights", "keyed_model_spec", "KeyedDataLoader", "TokenWindows"]


def keyed_init_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give ``model`` (a torchtitan model, parallelized or not) an ``init_weights`` that writes
    torchtitan's own init keyed: ``keyinit.init_model`` captures the model's ``init_states``
    (what ``BaseModel.init_weights`` calls) once on stand-ins and replays it for the region of
    each tensor this process holds. ``buffer_device`` is passed on as torchtitan passes it."""

    def init_weights(buffer_device: Optional[torch.device] = None, **_: Any) -> keyinit.InitReport:
        return keyinit.init_model(model, seed, init_method="init_states",
                                  init_kwargs={"buffer_device": buffer_device}, strict=False)

    model.init_weights = init_weights  # an instance attribute: the class (FSDP's too) is untouched
    return model


def keyed_model_spec(model_spec: Any, seed: int) -> Any:
    """A copy of a torchtitan ``ModelSpec`` whose ``parallelize_fn`` returns the parallelized
    model with :func:`keyed_init_weights` installed (pipeline stages included: torchtitan's
    ``pipeline_llm`` parallelizes each stage through the same ``parallelize_fn``)."""
    parallelize = model_spec.parallelize_fn

    def parallelize_keyed(model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        return keyed_init_weights(parallelize(model, **kwargs), seed)

    return dataclasses.replace(model_spec, parallelize_fn=parallelize_keyed)


class TokenWindows(Dataset):
    """A map-style dataset of ``(seq_len + 1)``-token windows of one token stream, cut at
    multiples of ``seq_len``: item ``i`` is ``({"input": w[:-1]}, w[1:])``, torchtitan's batch form."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
            raise ValueError(f"TokenWindows needs a 1-D token tensor of at least seq_len + 1 = {seq_len + 1} "
                             f"tokens, got shape {tuple(tokens.shape)}")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        start = int(index) * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1]
        return {"input": window[:-1]}, window[1:]


class KeyedDataLoader(BaseDataLoader):
    """A torchtitan dataloader whose order is keyinit's keyed sampler (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        """The data-order seed (independent of the init seed)."""
        dataset_fn: Optional[Callable[..., Dataset]] = None
        """Builds the map-style dataset: called as ``dataset_fn(tokenizer=..., seq_len=...)``."""
        num_workers: int = 0

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                 local_batch_size: int, **_: Any) -> None:
        if config.dataset_fn is None:
            raise ValueError("KeyedDataLoader.Config.dataset_fn is not set: give it a function "
                             "(tokenizer=..., seq_len=...) -> map-style Dataset")
        self.config = config
        self.dataset = config.dataset_fn(tokenizer=tokenizer, seq_len=seq_len)
        self.dp_rank, self.dp_world_size, self.local_batch_size = dp_rank, dp_world_size, local_batch_size
        self.micro_batch = local_batch_size * dp_world_size  # global positions per micro-step
        self.position = 0  # the next global sample position

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        if self.position % self.micro_batch:
            raise ValueError(f"KeyedDataLoader: cannot resume at global position {self.position} with "
                             f"{self.micro_batch} positions per micro-step (local_batch_size "
                             f"{self.local_batch_size} x dp {self.dp_world_size}): it must divide the position")
        sampler = KeyedSampler(len(self.dataset), self.config.seed, global_batch_size=self.micro_batch,
                               rank=self.dp_rank, world_size=self.dp_world_size,
                               start_step=self.position // self.micro_batch, num_steps=1 << 40)
        # its own generator: torch's DataLoader draws its workers' base seed from the global RNG otherwise
        generator = torch.Generator().manual_seed(self.config.seed)
        loader = DataLoader(self.dataset, batch_size=self.local_batch_size, sampler=sampler,
                            num_workers=self.config.num_workers, generator=generator)
        for batch in loader:
            self.position += self.micro_batch
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"keyed_position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:  # torchtitan loads an empty state for a fresh run
            self.position = int(state_dict["keyed_position"])
