"""keyinit.nn: keyed dropout, the same masks under any data, tensor, sequence or pipeline layout.

The keep-mask of an element is a pure function of (seed, step, the module's
canonical FQN, the call's ordinal in that module's forward, the element's
global index):

- :func:`keyinit.nn.functional.dropout`: keyed dropout of a tensor (plain local
  shard with ``global_shape``/``region``, or DTensor) under an explicit key;
- :class:`Dropout`: a drop-in for ``torch.nn.Dropout`` that never draws unkeyed;
- :func:`keyed`: a context manager under which every dropout in a model's forward
  (``nn.Dropout``, ``F.dropout``, HF eager attention, ...) is keyed;
- :func:`compile`: ``torch.compile`` for keyed forwards (keys and offsets are graph inputs);
- :func:`checkpoint`: ``torch.utils.checkpoint.checkpoint`` whose recompute is keyed as its first execution;
- :func:`dropout_key`: the key ``keyed`` gives a call (``docs/spec.md`` section 14);
- :class:`Randomness`: ``keyed(randomness=)``, how a keyed forward indexes, numbers and seeds its draws;
- :func:`stochastic_round`, :func:`stochastic_round_grad`: keyed stochastic rounding of activations and gradients.

See ``docs/dropout.md``.
"""

from keyinit.nn import functional
from keyinit.nn._compiled.compile import KeyedCompiled, compile
from keyinit.nn._context.api import batch_dim, checkpoint, keyed
from keyinit.nn._context.keyed import Keyed
from keyinit.nn._context.pipeline import micro_batches
from keyinit.nn._ops.keys import DROPOUT_DOMAIN, dropout_key
from keyinit.nn.modules import Dropout
from keyinit.nn.policy import Randomness
from keyinit.nn.sround import stochastic_round, stochastic_round_grad

__all__ = ["functional", "Dropout", "keyed", "Keyed", "batch_dim", "checkpoint", "micro_batches", "compile", "KeyedCompiled",
           "dropout_key", "DROPOUT_DOMAIN", "Randomness", "stochastic_round", "stochastic_round_grad"]
