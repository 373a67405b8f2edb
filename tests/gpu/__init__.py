"""The Triton kernels (interpreted without a GPU) and keyinit on a CUDA device: the CPU's values bit for bit."""
