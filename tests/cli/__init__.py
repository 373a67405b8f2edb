"""The keyinit command line: demo, verify (and its fidelity check), slice."""
