"""Running the model: one forward pass on the replica's own thread or across a group of shard
actors (one placement-group bundle each), the weights held in the served precision, packed and
compiled where that is faster, and the holds on the checkpoints they read."""
