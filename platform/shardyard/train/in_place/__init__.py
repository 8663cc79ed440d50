"""In-place resizing (`scaling.resize: in_place`): the run's workers are Ray actors of shardyard's
own (worker.py) that leave and join the running group at step boundaries, driven by run.py; Ray
Train restarts its whole group on every change, so it is not used here."""
