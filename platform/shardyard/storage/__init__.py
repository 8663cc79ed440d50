"""A run's storage (a local directory or object storage, storage/store.py) and the logs every part
of shardyard appends to it (storage/events.py): the ground floor that data, checkpoints, training,
serving and the pool all stand on."""
