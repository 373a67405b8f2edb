"""keyinit's exceptions, in one place so every module (init, dropout, CLI) raises the same classes."""

from __future__ import annotations

__all__ = ["PlanError", "InitError", "UnkeyedRandomnessError", "SharedDrawWarning", "LeftPaddingWarning"]


class PlanError(ValueError):
    """The model cannot be initialized as asked; nothing was written (or allocated).

    ``fqns`` lists the tensors the error is about (empty when it is about a rule or argument).
    """

    def __init__(self, message: str, fqns: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fqns = tuple(fqns)


class InitError(RuntimeError):
    """Writing failed part-way. ``written`` lists the FQNs that were already written."""

    def __init__(self, message: str, written: tuple[str, ...]) -> None:
        super().__init__(message)
        self.written = written


class UnkeyedRandomnessError(RuntimeError):
    """Code asked for randomness that keyinit cannot key (it never falls back to the global RNG).

    The message names the module and the op.
    """


class SharedDrawWarning(UserWarning):
    """Init code draws one random tensor that lands in model tensors a pipeline cut can separate.

    The draw is keyed by the first of them (spec section 15), so a stage without that tensor
    gets different values; the warning names the tensors.
    """


class LeftPaddingWarning(UserWarning):
    """A batch's ``attention_mask`` has padding before a real token in some row (left padding).

    keyinit names a random value by its coordinates within its sample (docs/spec.md 14.8, 16.4), so a
    real token moved right by padding gets the values of another position, and with dynamic padding
    they depend on how far its batch is padded. Raised by ``keyed_collate`` and ``keyed(samples=)``;
    the fix: pad on the right (``tokenizer.padding_side = "right"``) or pad every batch to one length.
    """
