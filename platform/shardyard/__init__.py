"""shardyard: elastic distributed training and sharded serving for PyTorch on Ray."""

__version__ = "0.1.0"
