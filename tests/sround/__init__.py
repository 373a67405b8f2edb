"""Keyed stochastic rounding: keyinit.random.stochastic_round and keyinit.optim.stochastic_rounding."""
