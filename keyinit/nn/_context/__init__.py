"""The ``keyinit.nn.keyed`` context: its entry points, its hooks and frames, and what it asks around a call.

- ``api.py``: ``keyed(model, seed, step=...)``, ``batch_dim`` and ``checkpoint``, the public entry points;
- ``keyed.py``: the context (:class:`~keyinit.nn._context.keyed.Keyed`): enter and exit, the hooks on the model;
- ``frames.py``: each thread's frames and modes, the frames opened for recomputes, and micro-batches;
- ``calls.py``: what a compiled module (``keyinit.nn.compile``) asks of the context around its call;
- ``copies.py``: copies of the model made while the hooks are on it (the model as it was);
- ``fullgraph.py``: a plain ``torch.compile`` forward inside ``keyed``: a warning, or a clear error;
- ``pipeline.py``: ``micro_batches``, each micro-batch of a pipeline schedule keyed with its own rows;
  ``unwrapped.py``: a schedule that drives a keyed stage without it, refused.

What other modules read of a running context is public: the modes use ``current_frame()``,
``thread_state()``, ``thread_local``, ``sequence_first`` and ``drawer`` (what its draws become:
:mod:`keyinit.nn._forward.drawer`) (typed as :class:`keyinit.nn._forward.intercept.Keyed`; a compiled
forward's ``TraceContext`` gives the same), a root forward ``constants`` and ``drew_rows()``, and
``micro_batches`` sets ``probing``. The recompute code uses ``forwards``, ``remember_replay()``,
``replayed()``, ``resume_region()``, ``enter_execution()``, ``leave_execution()`` and ``mark_recomputable()``
(:class:`~keyinit.nn._context.frames.FrameStack`).
"""
