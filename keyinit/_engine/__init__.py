"""The capture/replay engine (private): every way into keyinit becomes one program per tensor.

Its sub-packages, bottom up (each imports only those above it in this list, never one below):

- ``programs``: a tensor's values as a program and evaluating one: the IR (``program``: allocations,
  writes through strided views, element-wise and whole nodes, keyed draws, ``assign_keys``), the
  random-op table (``random_ops``: torch's random ops as keyed program nodes, their fast recipes in
  ``fast_recipes``, their batch in a keyed forward), the guards on user code keyinit runs (``guard``:
  no writes while planning, no unkeyed draws in a fill; ``refusal``: the one mode that refuses draws) and the evaluation of any region of a program
  (``replay``, keyed draws through ``keyinit._draw.dispatch``);
- ``capture``: running code on global-shape stand-ins and recording programs: the dispatch mode
  (``capture``), the stand-ins (``standin``), what each aten op is to it (``aten_kinds``), what it
  cannot record (``outside``: Python's and numpy's generators, threads) and real values for the
  stand-ins code keeps elsewhere (``escape``);
- ``keyed``: random ops of running code (keyed samples, collates and forwards) answered with keyed
  values: one op (``keyed_op``) and the dispatch key that sends only random ops to Python
  (``intercept``);
- ``deferred``: deferred construction: ``keyinit.deferred`` (a constructor recorded under a
  capture), the whole of a megatron-core split parameter in such a record (``megatron_records``) and
  lazy modules refused (``lazy``);
- ``planning``: the planner (``plan``: rules, records, init code and torch.nn defaults in the
  documented precedence), the init code it runs on stand-ins (``init_code``), the checks of its
  result (``plan_checks``, ``shared_draws``), what it decides (``planned``) and the options it reads
  (``options``);
- ``writing``: writing a plan into the model (``writer``: lowest precedence first, its undo and
  report), the loaded tensors ``materialize`` keeps (``kept``) and the one progress bar
  (``progress``).

The public face is :func:`keyinit.plan_init` / :class:`keyinit.Plan` (``keyinit/model.py``),
``keyinit.init_model``, ``keyinit.materialize`` and ``keyinit.deferred``. Nothing here is API:
names and modules may change without notice.
"""
