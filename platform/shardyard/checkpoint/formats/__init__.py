"""How each engine's checkpoint is written and read: DCP's sharded files for every strategy but
ZeRO (dcp.py), DeepSpeed's own files for ZeRO (zero.py). The manager (checkpoint/manager.py)
commits, prunes and picks; a format only writes and reads."""
