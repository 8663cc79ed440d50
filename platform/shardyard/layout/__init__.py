"""How a job lays out, as plain arithmetic (no torch): what each model family can be split into
(capabilities.py) and the mesh and accumulation at each world size a run may train at
(world_size.py). The spec asks both while validating, so that checking a config stays quick."""
