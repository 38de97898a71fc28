"""Triton kernels of the paged ops, one family a file; they know nothing of caches, validation or launch policy."""
