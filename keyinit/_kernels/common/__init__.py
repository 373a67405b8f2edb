"""What every kernel family shares: the build and the one loader of the C libraries, the distribution
and dtype ids, the C headers (Philox, conversions, the thread pool) and the Triton Philox."""
