"""keyed() on whole models: batch splits, steps, samples, host randomness, other stochastic layers, ranks and pipelines."""
