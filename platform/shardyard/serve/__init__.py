"""Serving trained models with Ray Serve: sharded models, batching, the HTTP app."""
