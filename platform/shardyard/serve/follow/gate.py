"""The gate every checkpoint passes before a client is answered by it, and the swap that follows:
a validation loss worse than the served one's (as the run logged them; not for an operator's own
choice), weights that are not finite (a diverged run), read beside the serving weights, or golden
prompts answered otherwise than they must be (judged once swapped in, in the engine's drained
window, before any client's request) are refused and counted; the others serve from the end of
that window. Engine-neutral: it speaks to the engine backend only (serve/engine/backend.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from shardyard.storage.events import read_metrics, validation_loss_at
from shardyard.checkpoint.published import Published, source_step
from shardyard.checkpoint.record import BadCheckpoint
from shardyard.serve.follow.app_weights import Source, with_few_published
from shardyard.serve.engine.backend import EngineBackend, WeightsRefused
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.engine.golden import GoldenPrompt, regressions
from shardyard.serve.engine.metrics import ServingMetrics


@dataclass
class Served:
    """What the replica serves and has judged, as /v1/models shows it."""
    step: int | None  # the training step of the weights answering (None: a model directory)
    fingerprint: str  # run@step
    sources: list[Source]  # every source served, in order (of published weights, the newest two)
    refused: dict[int, str] = field(default_factory=dict)  # steps the gate refused, and why
    candidate_step: int | None = None  # the checkpoint being read and judged

    @property
    def run_name(self) -> str:
        return self.fingerprint.rsplit("@", 1)[0]


class WeightGate:
    def __init__(self, cfg: ResolvedConfig, engine: EngineBackend, served: Served, metrics: ServingMetrics) -> None:
        self.cfg, self.engine, self.served, self.metrics = cfg, engine, served, metrics
        self._golden: tuple[str, list[str]] = ("", [])  # a fingerprint, its golden answers
        self._one_at_a_time = asyncio.Lock()  # the follower and the admin routes share the gate

    async def serve(self, checkpoint: Source, operator: bool = False, judged: bool = False) -> None:
        """Judge `checkpoint` and swap it in, or raise WeightsRefused (BadCheckpoint: a file that
        does not match its record). `operator`: an operator's own choice (no validation-loss
        check); `judged`: one another replica's golden prompts let through (not asked again)."""
        served = self.served
        async with self._one_at_a_time:
            step = source_step(checkpoint)
            served.candidate_step = step
            try:
                worse = None if operator else await asyncio.to_thread(self._worse_validation, step)
                if worse:
                    raise WeightsRefused(f"{checkpoint}: {worse}")
                # Weights served before passed the golden prompts then (a rollback, a canary stepping
                # back): judged against the ones they replace, they would fail for having answered first.
                golden = [] if judged or checkpoint in served.sources else self.cfg.follow.golden_prompts
                try:
                    await self.engine.stage(checkpoint if isinstance(checkpoint, Published) else str(checkpoint))
                except WeightsRefused as err:
                    raise WeightsRefused(f"{checkpoint} {err}") from None
                await self._swap_judged(checkpoint, f"{served.run_name}@{step}", golden)
            except (WeightsRefused, BadCheckpoint) as err:
                served.refused[step] = str(err)
                self.metrics.promotions_refused.inc()
                raise
            finally:
                served.candidate_step = None
            served.refused.pop(step, None)  # an operator's promotion of a step refused before
            served.sources = with_few_published([*served.sources, checkpoint])
            served.step, served.fingerprint = step, self.engine.weights
            self.metrics.promotions.inc()
            print(f"shardyard: serving {served.fingerprint}", flush=True)

    async def _swap_judged(self, checkpoint: Source, fingerprint: str, golden: list[GoldenPrompt]) -> None:
        """In the engine's drained window: the staged weights serve from its end, once they
        answer the `golden` prompts as they must; else the served ones stay (WeightsRefused)."""
        engine = self.engine
        async with engine.drained():
            if golden and self._golden[0] != engine.weights:  # the served weights' answers, once
                self._golden = (engine.weights, await engine.golden_answers(golden))
            await engine.swap()
            failed: list[str] | None = None  # None: the golden passes did not finish (a shard lost)
            try:
                answers = await engine.golden_answers(golden) if golden else []
                failed = regressions(golden, self._golden[1], answers, self.cfg.follow.golden_max_edit_distance)
            except WeightsRefused as err:
                failed = [str(err)]
            finally:
                if failed != []:
                    await engine.swap_back()
            if failed:
                raise WeightsRefused(f"{checkpoint}: " + "; ".join(failed))
            if golden:
                self._golden = (fingerprint, answers)
            engine.weights = fingerprint

    def _worse_validation(self, step: int) -> str | None:
        """Why the run's own validation loss keeps `step` from serving (None: it does not, or the
        run logged none to compare)."""
        tolerance, served_step = self.cfg.follow.val_loss_tolerance, self.served.step
        if tolerance is None:
            return None
        rows = read_metrics(self.cfg.source)
        candidate, served = validation_loss_at(rows, step), validation_loss_at(rows, served_step or 0)
        if candidate is None or served is None or candidate <= served * (1 + tolerance):
            return None
        return (f"its validation loss {candidate:.4f} is worse than the served step {served_step}'s "
                f"{served:.4f} by more than {tolerance:.0%}")


def served_at_start(cfg: ResolvedConfig) -> Served:
    return Served(cfg.served_step, cfg.fingerprint, [Path(cfg.checkpoint)])
