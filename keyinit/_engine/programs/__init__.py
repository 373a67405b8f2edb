"""A tensor's values as a program, and evaluating one: the IR (``program``), torch's random ops as its
keyed nodes (``random_ops``), the guards on user code keyinit runs (``guard``) and the evaluation of any
region of a program on the CPU, bit-identically under any layout (``replay``).
"""
