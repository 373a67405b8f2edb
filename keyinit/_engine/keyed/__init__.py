"""Random ops of running code answered with keyed values, not captured: what keyed samples, keyed collates
and keyed forwards run. One op and its keyed values (``keyed_op``), and the dispatch key that sends only
the random aten ops of a thread to Python (``intercept``).
"""
