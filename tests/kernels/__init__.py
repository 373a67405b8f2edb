"""The compiled C kernels: building and loading them, their self-tests, and bit-equality with the Python reference."""
