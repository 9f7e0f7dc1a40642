"""Tensor parallelism across processes: the ranks, how they start and meet, and what rank 0
tells the others each step (docs/distributed.md)."""
