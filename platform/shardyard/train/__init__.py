"""Training on Ray Train: the launcher (driver side, the one Ray Train adapter), the per-worker loop, metrics."""
