"""How a job lays out: what each model family can be split into (capabilities.py) and the mesh
and accumulation at each world size a run may train at (world_size.py), as plain arithmetic the
spec asks while validating (no torch at import, so that checking a config stays quick); and a
module's repeated blocks and parameter names (blocks.py), the traversal that sharding, activation
checkpointing and initialisation all split a model by; and the sharded layouts DCP can store
(dcp_placements.py)."""
