"""Keyed data order and augmentation: the name of a sample's randomness is (epoch, sample index).

- :func:`permutation` / :func:`inverse_permutation`: a keyed bijection of ``range(n)``
  (``n`` up to ``2**62``) with random access;
- :class:`KeyedSampler`: the global batch of step ``t`` is the same for every world
  size, every sample appears once per epoch, resume from any step with any world size;
- :func:`keyed_samples`: torch/``random``/numpy randomness inside a dataset's
  ``__getitem__`` keyed by (seed, epoch, sample index, call ordinal).

See ``docs/data.md`` and ``docs/spec.md`` section 16.
"""

from keyinit.data._augment import KeyedBatch, SampleRef, keyed_samples, sample_key
from keyinit.data._collate import KeyedCollate, collate_key, keyed_collate
from keyinit.data._index import SampleIndex, sample_index
from keyinit.data._permutation import inverse_permutation, permutation
from keyinit.data._positions import SampleDict, SampleList, SamplePositions, SampleTuple, sample_positions
from keyinit.data._sampler import KeyedSampler

__all__ = ["permutation", "inverse_permutation", "KeyedSampler", "keyed_samples", "sample_key", "SampleRef",
           "SampleIndex", "sample_index", "KeyedBatch", "keyed_collate", "collate_key", "KeyedCollate",
           "SamplePositions", "sample_positions", "SampleDict", "SampleList", "SampleTuple"]
