"""``keyinit.nn.Dropout``: a drop-in for ``torch.nn.Dropout`` that only ever draws keyed masks."""

from __future__ import annotations

import torch

from keyinit.errors import UnkeyedRandomnessError

__all__ = ["Dropout"]


class Dropout(torch.nn.Module):
    r"""Zero each element with probability ``p`` during training, scaling the rest by :math:`1/(1-p)`.

    Like :class:`torch.nn.Dropout`, but the mask is keyed: inside
    :func:`keyinit.nn.keyed` the forward of this module is call 0 of its own
    canonical FQN, so element ``i`` (global index, dimension 0 the batch) is kept iff
    ``keyinit.random.bernoulli(dropout_key(seed, step=step, fqn=fqn, ordinal=0), ..., p=1 - p)`` is
    True there; an ``nn.Dropout`` at the same FQN draws the same mask. In
    training mode with ``p > 0`` outside a keyed forward it raises
    :class:`keyinit.errors.UnkeyedRandomnessError` instead of drawing from the global
    RNG. In eval mode (or with ``p = 0``) it returns its input.

    Args:
        p: probability of an element to be zeroed, in ``[0, 1]``. Default: 0.5
        inplace: write the result into the input. Default: ``False``
    """

    __constants__ = ["p", "inplace"]
    p: float
    inplace: bool

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p!r}")
        self.p = float(p)
        self.inplace = bool(inplace)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return input
        from keyinit.nn._context.keyed import inside_keyed_forward

        if not inside_keyed_forward():
            raise UnkeyedRandomnessError(
                f"keyinit.nn.Dropout(p={self.p}) ran in training mode outside a keyinit.nn.keyed forward; it never "
                "draws an unkeyed mask. Run the model's forward inside `with keyinit.nn.keyed(model, seed, "
                "step=step, sample_offset=...)`, with this module part of that model, or call model.eval()."
            )
        return torch.nn.functional.dropout(input, self.p, True, self.inplace)
