"""Run storage and checkpoints, below training and serving: storage (store), the run's lease
(lease), which launch wrote which checkpoint (generations), reader holds (reader_holds), the event
log (events), what a checkpoint holds (layout) and its commit record (record), loading that runs
no code (safe_load), one format per engine (dcp_format, zero_format), the manager that commits,
prunes and restores (manager), and the single-process loaders serving and export use (loaders)."""
