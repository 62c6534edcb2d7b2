"""Triton kernels for paged attention, KV writes and block copies, with their torch references."""
