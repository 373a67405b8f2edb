"""The keyed permutation family (C on CPU, Triton on CUDA, a golden self-test)."""
