"""The engine: one process per pod, serving one model with a paged, prefix-cached KV cache."""
