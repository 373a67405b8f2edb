"""``keyinit.nn.compile``: a keyed forward under ``torch.compile``, its keys and sample offset graph inputs.

- ``compile.py``: the public function and :class:`~keyinit.nn._compiled.compile.KeyedCompiled` (the module
  compiled with keyinit's backend, which traces each graph dynamo captures under keyed()'s modes);
- ``tracing.py``: tracing one such graph;
- ``sites.py``: the random sites of a traced graph, two custom ops whose keys and offset are tensor inputs;
- ``undo.py``: putting back what a compiled call changed (writes of a graph traced for real, a call undone).

(Named ``_compiled`` so that the package does not shadow the function ``keyinit.nn.compile``.)
"""
