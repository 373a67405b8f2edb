"""``keyinit.nn.Randomness``: the one value that says how a keyed forward keys its draws (``keyed(randomness=)``).

A keyed forward makes three choices about its random values (``docs/spec.md`` 14.4, 14.6, 14.7):

- ``index``: how an element finds its sample. ``"tracked"`` (the default) follows the batch through
  every op (14.6); ``"dim0"`` reads dimension 0 of each dropout input as the batch and refuses every
  other draw (14.4, stream v1's first rule).
- ``calls``: how a module's call ordinals are counted. ``"forward"`` goes on across the module's
  executions in one root forward, so they never share a key; ``"execution"`` restarts at each
  execution (14.4). Not given, it is ``"execution"`` with ``index="dim0"`` (that rule, whole) and
  ``"forward"`` otherwise.
- ``host``: what seeds Python's ``random`` and ``numpy.random`` in a root forward (14.7). ``"sample"``
  (the default): the forward's one sample, and a forward of several samples that draws from them is
  refused; ``"rows"``: the rows the forward holds (the same values for the same rows, but they depend
  on how the batch is split); ``"replicated"``: the root forward's key alone (the same values in
  every forward of the step).

These were three keywords of ``keyed`` (``index=``, ``calls=``, ``host_random=``), in which "forward"
meant both a root forward (``calls="forward"``) and the rows it holds (``host_random="forward"``, now
``host="rows"``). The keywords still work, with a :class:`DeprecationWarning` naming the new spelling
(:func:`resolve`), and key exactly as the same :class:`Randomness` does.
"""

from __future__ import annotations

import warnings
from typing import Optional

import attrs

__all__ = ["Randomness", "INDEX", "CALLS", "HOST"]

#: The values of :attr:`Randomness.index`.
INDEX = ("tracked", "dim0")
#: The values of :attr:`Randomness.calls`.
CALLS = ("forward", "execution")
#: The values of :attr:`Randomness.host`.
HOST = ("sample", "rows", "replicated")

#: ``host`` as the deprecated ``keyed(host_random=)`` spelled it (the only value whose name changed).
_HOST_RANDOM = {"sample": "sample", "rows": "forward", "replicated": "replicated"}
_HOST = {old: new for new, old in _HOST_RANDOM.items()}


def _one_of(values: tuple, renamed: Optional[dict] = None):
    """An attrs validator: the value is one of ``values``; ``renamed`` maps an old name to its new one."""
    def check(instance: "Randomness", attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, str) or value not in values:
            new = (renamed or {}).get(value) if isinstance(value, str) else None
            more = f" (the old spelling {value!r} is {attribute.name}={new!r})" if new else ""
            raise ValueError(f"keyinit.nn.Randomness: {attribute.name} must be one of {values}, got {value!r}{more}")
    return check


@attrs.frozen
class Randomness:
    """How a keyed forward keys its draws: ``keyinit.nn.keyed(model, seed, step=..., randomness=Randomness(...))``.

    ``Randomness()`` is the default (``index="tracked"``, ``calls="forward"``, ``host="sample"``);
    ``Randomness(index="dim0")`` is stream v1's first rule, whole (its ``calls`` is ``"execution"``).
    See the module docstring for what each field means.
    """

    index: str = attrs.field(default="tracked", validator=_one_of(INDEX), kw_only=True)
    calls: str = attrs.field(validator=_one_of(CALLS), kw_only=True)
    host: str = attrs.field(default="sample", kw_only=True, validator=_one_of(HOST, {"forward": "rows"}))

    @calls.default
    def _calls(self) -> str:
        return "execution" if self.index == "dim0" else "forward"

    def keyed_arguments(self) -> tuple[str, str, str]:
        """``(index, calls, host_random)`` in the spelling the keyed context takes."""
        return self.index, self.calls, _HOST_RANDOM[self.host]


def _spelled(index: Optional[str], calls: Optional[str], host_random: Optional[str]) -> tuple[str, str]:
    """The deprecated keywords as given, and the ``Randomness(...)`` that says the same."""
    old = ", ".join(f"{name}={value!r}" for name, value in
                    (("index", index), ("calls", calls), ("host_random", host_random)) if value is not None)
    new = ", ".join(f"{name}={value!r}" for name, value in
                    (("index", index), ("calls", calls),
                     ("host", None if host_random is None else _HOST.get(host_random, host_random)))
                    if value is not None)
    return old, f"keyinit.nn.Randomness({new})"


def resolve(randomness: Optional[Randomness], *, index: Optional[str] = None, calls: Optional[str] = None,
            host_random: Optional[str] = None, stacklevel: int = 3) -> tuple[str, Optional[str], str]:
    """``keyed``'s ``randomness=`` or its deprecated ``index=``/``calls=``/``host_random=``, as the
    ``(index, calls, host_random)`` the keyed context takes (``calls`` None: the index rule's own).

    The deprecated keywords are passed on as given (an unknown value is the context's ``ValueError``),
    after a :class:`DeprecationWarning` that names the ``Randomness`` saying the same; both at once is a
    ``TypeError``.
    """
    if index is None and calls is None and host_random is None:
        if randomness is None:
            return "tracked", None, "sample"
        if not isinstance(randomness, Randomness):
            raise TypeError(f"keyed: randomness must be a keyinit.nn.Randomness, got {type(randomness).__name__}")
        return randomness.keyed_arguments()
    old, new = _spelled(index, calls, host_random)
    if randomness is not None:
        raise TypeError(f"keyed: give randomness= or the deprecated {old}, not both (it is randomness={new})")
    warnings.warn(f"keyed(..., {old}) is deprecated: use keyed(..., randomness={new})", DeprecationWarning,
                  stacklevel=stacklevel)
    return ("tracked" if index is None else index), calls, ("sample" if host_random is None else host_random)
