"""A tensor's values as a program, and evaluating one: the IR (``program``), the random-op table
(``random_ops``: each torch random op's keyed program nodes, its output's batch in a keyed forward, and
its fast CPU recipe in ``fast_recipes``), the guards on user code keyinit runs (``guard``), the one mode that refuses random draws (``refusal``) and the
evaluation of any region of a program on the CPU, bit-identically under any layout (``replay``).
"""
