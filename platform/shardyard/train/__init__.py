"""Training on Ray Train: the launcher (driver side), the per-worker loop, checkpoints, metrics."""
