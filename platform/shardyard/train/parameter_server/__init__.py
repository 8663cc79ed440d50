"""Asynchronous data parallelism through parameter servers (`strategy: parameter_server`).

The parameters are partitioned by tensor over K `ParameterServer` actors, balanced by size. Each
`PSWorker` actor loops: ask the `Coordinator` for the next batch, pull the current parameters
from every server, compute its batch's gradient, push each server its part. A server applies
each gradient with its own optimizer the moment it arrives (one at a time: actor calls run in
order) and records its staleness, the number of updates it applied between that worker's pull
and this push. With `max_staleness: S` the coordinator holds back a worker more than S pushes
ahead of the slowest live one (stale-synchronous parallel); with W workers no gradient is then
more than (W - 1)(2S + 1) updates stale. With S null nobody waits (fully asynchronous).

Each worker batch is global_batch / W samples (W the worker slots: scaling.num_workers, or
max_workers when elastic) and each push one optimizer step, so a global step is W updates however
many workers are alive; one worker with S = 0 is single-process training exactly.

Exactly once, across failures:
- Every push carries an id, (generation, batch offset). A server applies an id at most once: a
  worker that died after pushing to some servers has its batch handed out again, and the servers
  that applied it already skip the retry's push.
- Checkpoints are consistent cuts. The coordinator hands out batches only up to the next
  checkpoint boundary; once every batch below it is applied everywhere, the driver pulls every
  server's parameters and optimizer state and writes them through the Trainer's
  `CheckpointManager`, in the same layout as every other strategy (so any strategy resumes from
  it and it resumes from any), then opens the next stretch.
- A server that dies comes back empty (Ray restarts it). The driver then rolls the whole run back
  to the newest committed checkpoint under a new generation: every server reloads it, the
  coordinator restarts at its position, and pushes of the old generation are refused. A worker
  that dies is replaced by a new actor; workers join whenever a node brings room for one.
- With `run.sample_ledger`, workers record each batch's samples once all its pushes are applied,
  and the driver commits the steps of each cut: the audit then checks every sample of each epoch
  was used exactly once.

    actors.py  the servers, the coordinator and the workers (Ray actors)
    run.py     the driver: starts them, replaces dead workers, rolls back, checkpoints each cut
"""
