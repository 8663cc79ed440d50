"""Where a training run publishes its weights to a serving app (`checkpoint.publish_to`): one
WeightsInbox deployment per app that follows a run (Serve starts and deletes it with the app).
Training's rank 0 puts the newest published weights (a reference into Ray's object store, the
weights themselves stay there); each replica's follower looks here beside the run's storage."""

from __future__ import annotations

from ray import serve

from shardyard.checkpoint.published import Published

INBOX = "WeightsInbox"  # the deployment's name: training finds it with serve.get_deployment_handle


@serve.deployment(name=INBOX, num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # every replica asks it at each look
class WeightsInbox:
    def __init__(self) -> None:
        self.newest: Published | None = None

    def put(self, published: Published) -> None:
        """Keep `published` if it is newer than what is here (its reference keeps the weights alive)."""
        if self.newest is None or published.run != self.newest.run or published.step > self.newest.step:
            self.newest = published

    def latest(self) -> Published | None:
        return self.newest
