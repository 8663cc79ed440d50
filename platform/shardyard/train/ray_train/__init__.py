"""The one Ray Train adapter: its run (run.py), its workers (worker.py), what it is told
(config.py) and where its workers go (worker_resources.py). Nothing else in shardyard imports
Ray Train."""
