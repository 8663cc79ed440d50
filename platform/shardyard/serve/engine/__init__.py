"""Deciding what runs: the backend protocol the routes and the follower speak to, the built-in
engine (a pure scheduler over paged KV blocks, continuous or static batches) and the vLLM
engine behind the same protocol, with the metrics they record."""
