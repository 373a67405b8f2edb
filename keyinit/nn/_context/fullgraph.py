"""A plain ``torch.compile(model)`` forward called inside ``keyinit.nn.keyed``: a warning, or a clear error.

Dynamo does not trace keyed()'s hooks and modes: a ``torch.compile`` forward inside ``keyed`` runs eagerly,
with a warning (:func:`warn_if_compiled`); where a graph break is an error (``fullgraph=True``), dynamo raises
its own message about keyinit's internals instead. :func:`refuse_full_graph` turns that error, when it
leaves a keyed block, into one that names the way: ``keyinit.nn.compile``.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["refuse_full_graph", "warn_if_compiled"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # keyinit/

FULL_GRAPH = (
    "keyinit.nn.keyed: torch.compile(model, fullgraph=True) cannot trace a forward inside keyed() (dynamo "
    "breaks the graph at keyinit's hooks and modes, which fullgraph=True makes an error); compile the model "
    "with keyinit.nn.compile(model, fullgraph=True) to key a compiled forward, or drop fullgraph=True to run "
    "the torch.compile forward eagerly under keyed()"
)


def refuse_full_graph(exc: BaseException) -> None:
    """Raise :data:`FULL_GRAPH` (from ``exc``) when ``exc`` is dynamo's error on tracing keyinit's code: a graph
    break there (``Unsupported``), or, once dynamo has skipped those frames, its ``RuntimeError`` that a
    ``fullgraph=True`` call compiled no frame."""
    dynamo = sys.modules.get("torch._dynamo.exc")  # (not imported: nothing was compiled)
    base = getattr(dynamo, "TorchDynamoException", None)
    if base is None or _PACKAGE not in str(exc):
        return
    if isinstance(exc, base) or (type(exc) is RuntimeError and str(exc).startswith(_NO_FRAMES)):
        raise RuntimeError(FULL_GRAPH) from exc


_NO_FRAMES = "torch.compile with fullgraph=True found no compiled frames"


def warn_if_compiled() -> None:
    """A ``torch.compile(model)`` called inside ``keyed``: dynamo does not trace under keyed()'s modes, so it
    runs eagerly (right values, nothing compiled); ``keyinit.nn.compile`` is the compiled form."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled (and importing
    is_in = getattr(eval_frame, "_is_in_optimized_module", None)  # dynamo costs seconds)
    if is_in is not None and is_in():
        warnings.warn("keyinit.nn.keyed: a torch.compile(model) forward runs eagerly under keyed() (dynamo does not "
                      "trace under its modes); compile it with keyinit.nn.compile(model) to key a compiled forward",
                      stacklevel=4)
