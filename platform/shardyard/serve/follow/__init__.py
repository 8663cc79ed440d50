"""Serving a run while it trains: the follower that notices its new checkpoints, the gate that
checks them (golden prompts, finite weights) before they serve, the app's weight history and the
rollout across replicas."""
