"""Checkpoints, below training and serving (on the run's storage, storage/): the run's lease
(lease), which launch wrote which checkpoint (generations), reader holds (reader_holds), what a
checkpoint holds (layout) and its commit record (record), loading that runs no code (safe_load),
one format per engine (formats/dcp.py, formats/zero.py), the manager that commits, prunes and
restores (manager), and the single-process loaders serving and export use (loaders)."""
