"""What every `shardyard` command (and jobs/train.py) exits with: each outcome its own code, so a
scheduler (a RayJob's backoff, a shell loop, a spot-instance script) can tell "launch it again"
from "fix something first"."""

DONE = 0
GAVE_UP = 1  # the run stopped and retrying would not help: a repeated error, divergence, a lost lease
REFUSED = 2  # nothing started: a bad spec, a run held by another launch, storage that cannot fence,
#              a bad checkpoint to export or serve, a port already taken
NOTHING_FITS = 1  # shardyard plan: no parallelism fits the devices named
NOT_STARTED = 1  # shardyard serve: the application's replicas did not start (Serve's reason is printed)
PREEMPT_TIMED_OUT = 3  # SIGTERM, but no checkpoint committed within checkpoint.preempt_timeout_s:
#                        a new launch resumes from the last committed one; the steps since are lost
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): as PREEMPTED, nothing lost, unless a second Ctrl-C stopped
#                    it at once (its message says from which step a new launch resumes)
PREEMPTED = 143  # SIGTERM (128 + 15), nothing lost: training had not begun, or it committed the
#                  step it stopped at; launching again continues from there
