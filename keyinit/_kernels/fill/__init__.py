"""The fill family: a distribution's values for a region (C on CPU, Triton on CUDA, a golden self-test)."""
