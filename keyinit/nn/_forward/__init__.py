"""A running keyed forward and what its draws become.

- ``pieces.py``: the pieces of a keyed block (a root forward and the rows it holds, named blocks, how a
  checkpoint's recompute finds its first execution);
- ``modes.py``: the two modes of a keyed forward (torch-function routing; ATen-level batch tracking and draws);
- ``intercept.py``: what the modes do at a dropout or attention call (a frame, keyed masks, each
  activation's batch);
- ``dropout.py``: dropout of an activation whose batch is its dimension 0, without hooks;
- ``draws.py``: the keyed values of every other random ATen op, per sample or replicated;
- ``drawer.py``: what the draws become, one drawer per context (the eager one here; a compiled trace's is
  :class:`keyinit.nn._compiled.sites.Trace`), so no draw site asks which kind of forward runs;
- ``hostrandom.py``: Python's ``random`` and ``numpy.random`` inside a keyed forward.

The ``keyed()`` context that opens these (hooks, frames, enter and exit) is :mod:`keyinit.nn._context`.
"""
