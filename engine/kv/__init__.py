"""The engine's KV manager: block pool, prefix hashing, eviction policy. Knows nothing of tensors."""
