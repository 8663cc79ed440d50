"""A task of the user's own (jobs/vision.py: a CNN, synthetic images, cross-entropy) through the
real Trainer on torch.distributed gloo ranks: under DDP, FSDP2, ZeRO-2 and ZeRO-3 it ends where one
process trained on the whole global batch ends (plain SGD, no clipping: a wrong gradient scale
would show), a run stopped at step 2 on 2 ranks and resumed on 1 ends there too with every
sample used once, and the spec refuses what such a task cannot do, before any worker starts
(serving, which answers language models, refuses its runs)."""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.checkpoint.record import checkpoint_name
from shardyard.data import UserStream, build_dataset, build_validation
from shardyard.data.ledger import audit
from shardyard.localdist import run_distributed
from shardyard.serve.resolved import load_config
from shardyard.models import build_model, metrics_fn_for
from shardyard.parallel import single_process
from shardyard.parallel.engine import measured
from shardyard.spec import JobSpec, SpecError, parse_spec, validate
from shardyard.train.efficiency import module_flops_per_sample
from shardyard.train.metrics import read_metrics
from shardyard.train.callbacks import LedgerCallback, group_attempt
from shardyard.train.trainer import Trainer
from helpers.oracle import PARAM_TOL, SGD, steps
from jobs.vision import SyntheticImages

STEPS = 4
VALIDATION = 40  # 2 whole global batches of 16 are validated, the 8 left over never
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3")


def vision_job(strategy: str, world: int, storage: Path | None = None, steps_: int = STEPS,
               dataset: str = "jobs.vision:SyntheticImages", num_samples: int = 96) -> dict:
    return {
        "model": {"name": "module", "factory": "jobs.vision:small_cnn", "options": {"channels": 4, "size": 8}},
        "data": {"name": "factory", "factory": dataset, "options": {"num_samples": num_samples, "size": 8, "seed": 3},
                 "validation_options": {"num_samples": VALIDATION, "split": "validation"}},
        "loss": {"factory": "jobs.vision:cross_entropy"},
        "metrics": {"factory": "jobs.vision:accuracy"},
        "eval": {"every_n_steps": 2, "batches": 4},  # the 2 whole global batches there are
        "optim": SGD | {"lr": 0.2},
        "batch": {"global_batch_size": 16, "micro_batch_size": 4},  # accumulation 2 on 2 ranks, 4 on 1
        "parallelism": {"strategy": strategy},
        "scaling": {"num_workers": world} if world > 1 else {"min_workers": 1, "max_workers": 2},
        "checkpoint": {"every_n_steps": 2, "keep": 5, **({"storage_path": str(storage)} if storage else {})},
        "run": {"steps": steps_, "seed": 7, "log_every": 1, "name": "run"},
    }


def oracle(**data: Any) -> dict[str, torch.Tensor]:
    """STEPS steps in one process on the whole global batch of 16."""
    return oracle_run(**data)[0]


def oracle_run(**data: Any) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The parameters after STEPS steps in one process on the whole global batch of 16, and its
    validation then: the loss and accuracy over the first 32 validation samples in one pass."""
    raw = vision_job("ddp", 1, **data)
    raw["batch"] = {"global_batch_size": 16, "micro_batch_size": 16}
    raw["scaling"] = {"num_workers": 1}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    steps(engine, spec, 0, STEPS)
    validated = engine.validate([build_validation(spec).batch(torch.arange(32))], metrics_fn_for(spec))
    return ({k: v.detach().clone() for k, v in engine.model.state_dict().items()},
            {f"val_{name}": value.item() for name, value in validated.items()})


def train_each_strategy(rank: int, world: int, out: str) -> dict[str, str | None]:
    """Every strategy to STEPS on `world` ranks, each in its own storage; a failure by name."""
    failures: dict[str, str | None] = {}
    for strategy in STRATEGIES:
        try:
            raw = vision_job(strategy, world, Path(out) / strategy)
            Trainer.build(parse_spec(raw), rank, world, torch.device("cpu")).train()
            failures[strategy] = None
        except Exception:  # noqa: BLE001 - reported by name in the main process
            failures[strategy] = traceback.format_exc()
    return failures


def train_until(rank: int, world: int, raw: dict, until: int | None) -> None:
    spec = parse_spec(raw)
    callbacks = [LedgerCallback(spec.run_uri, f"rank{rank}", group_attempt())] if spec.run.sample_ledger else []
    Trainer.build(spec, rank, world, torch.device("cpu"), callbacks=callbacks).train(until)


@pytest.mark.timeout(600)
def test_own_model_data_and_loss_train_as_one_process_under_each_strategy(tmp_path: Path) -> None:
    failures = run_distributed(train_each_strategy, 2, str(tmp_path))[0]
    expected, validated = oracle_run()
    assert 0 < validated["val_accuracy"] < 1, validated  # a metric that can differ
    for strategy in STRATEGIES:
        assert failures[strategy] is None, f"{strategy}:\n{failures[strategy]}"
        last = read_metrics(tmp_path / strategy / "run")[-1]
        assert last["step"] == STEPS and "val_perplexity" not in last, last
        for name, value in validated.items():  # the validation of ranks' shares is the whole one's
            assert last[name] == pytest.approx(value, abs=1e-5), f"{strategy}: {name} {last}"
        got = load_model(find_latest(tmp_path / strategy / "run"), trust_factory="jobs.vision:small_cnn").state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=f"{strategy}: {name}")
        moved = max((got[n] - build_reference_start()[n]).abs().max().item() for n in expected)
        assert moved > 100 * PARAM_TOL, f"{strategy}: training moved nothing ({moved})"


def build_reference_start() -> dict[str, torch.Tensor]:
    spec = parse_spec(vision_job("ddp", 2))
    torch.manual_seed(spec.run.seed)
    return build_model(spec.model).state_dict()


class ImageStream(torch.utils.data.IterableDataset):
    """The example's images as a stream of the user's, read in order from `start`."""

    def __init__(self, start: int = 0, **images: Any) -> None:
        self.start, self.images = start, images

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        images = SyntheticImages(**self.images)
        return (images[i] for i in range(self.start, len(images)))


class SkippingImageStream(ImageStream):
    """A stream that starts n samples later when asked, as Hugging Face's streams do."""

    def skip(self, n: int) -> SkippingImageStream:
        return SkippingImageStream(self.start + n, **self.images)


def image_generator(**images: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A generator of the images: a stream without skip(), read past to resume."""
    yield from ImageStream(**images)


@pytest.mark.parametrize("factory", [SkippingImageStream, image_generator])
def test_a_stream_gives_the_sample_at_each_position_across_its_passes(factory) -> None:
    images = SyntheticImages(num_samples=24, size=8, seed=3).images

    def read(stream: UserStream, positions: list[int]) -> torch.Tensor:
        return stream.batch(torch.tensor(positions))[0]

    stream = UserStream(lambda: factory(num_samples=24, size=8, seed=3))
    # Forward across a pass's end, back (a new stream), then passes ahead.
    for positions in ([0, 1, 2], [22, 23, 24, 25], [5, 6], [60, 61], [100, 101]):
        assert torch.equal(read(stream, positions), images[[p % 24 for p in positions]]), positions
    assert stream.length == 24
    # Opened first in the second pass: a skip() past the end is read again from the start.
    assert torch.equal(read(UserStream(lambda: factory(num_samples=24, size=8, seed=3)), [32]), images[[8]])
    with pytest.raises(ValueError, match="yielded no samples"):
        read(UserStream(lambda: iter(())), [0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("data", [{}, {"dataset": f"{__name__}:SkippingImageStream", "num_samples": 24}],
                         ids=["map-style", "stream"])
def test_own_task_stopped_on_two_ranks_resumes_on_one_and_is_not_served(tmp_path: Path, data: dict) -> None:
    """The stream's 24 samples end within a step: 4 steps of 16 read 64 positions over 3 passes,
    and the launch on 1 rank opens it at position 32, in its second pass."""
    raw = vision_job("ddp", 1, tmp_path, **data)
    raw["run"]["sample_ledger"] = True
    run_distributed(train_until, 2, raw, 2)
    run_distributed(train_until, 1, raw, None)
    final = load_model(find_latest(tmp_path / "run"), trust_factory="jobs.vision:small_cnn").state_dict()
    for name, value in oracle(**data).items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=PARAM_TOL, msg=name)
    report = audit(tmp_path / "run", STEPS * 16 if data else 96)
    assert report.exact and report.world_sizes == [2, 2, 1, 1], report
    # The second launch resumed from the first one's checkpoint of step 2 (it saved at 2 only).
    saved = sorted(p.name for p in (tmp_path / "run").glob("checkpoint_step_*"))
    assert saved == [checkpoint_name(2), checkpoint_name(STEPS)], saved
    # Serving answers language models: the run is refused with what to do instead, not a traceback.
    with pytest.raises(SpecError, match="holds a module of the user's own .* `shardyard export"):
        load_config({"checkpoint": str(tmp_path / "run")}, use_gpu=False)


@pytest.mark.parametrize(("change", "message"), [
    ({"data": {"name": "corpus"}}, "model.name 'module' trains on a dataset of the user's own"),
    ({"loss": None}, "model.name 'module' needs loss.factory"),
    ({"parallelism": {"strategy": "pipeline", "pp": 2}}, "is not split into pipeline stages"),
    ({"parallelism": {"strategy": "tensor", "tp": 2}}, "is not split by tensor parallelism"),
    ({"loss": {"factory": "jobs.vision:no_such_loss"}}, "loss.factory: 'jobs.vision' has no function 'no_such_loss'"),
    ({"data": {"name": "factory", "factory": "no_such_package:images"}}, "data.factory: cannot import 'no_such_package'"),
    ({"data": {"name": "factory"}}, "data.factory names the dataset of data.name 'factory'"),
    ({"eval": {}}, "metrics.factory is computed at validation: set eval.every_n_steps"),
    ({"data": {"name": "factory", "factory": "jobs.vision:SyntheticImages"}},
     "eval.every_n_steps validates a task of the user's own on data.validation_options"),
    ({"metrics": {"factory": "jobs.vision:no_such_metric"}}, "metrics.factory: 'jobs.vision' has no function"),
])
def test_the_spec_refuses_what_a_task_of_ones_own_cannot_do(change: dict, message: str) -> None:
    raw = vision_job("ddp", 2)
    raw.update(change)
    if raw["loss"] is None:
        del raw["loss"]
    with pytest.raises(SpecError, match=re.escape(message)):
        validate(JobSpec, raw, "job spec")


def test_a_language_model_keeps_its_own_loss_data_and_validation() -> None:
    raw = {"model": {"name": "gpt"}, "loss": {"factory": "jobs.vision:cross_entropy"}}
    with pytest.raises(SpecError, match="model.name 'gpt' has its own"):
        validate(JobSpec, raw, "job spec")
    with pytest.raises(SpecError, match="model.name 'gpt' is validated by its loss and perplexity"):
        validate(JobSpec, {"model": {"name": "gpt"}, "metrics": {"factory": "jobs.vision:accuracy"}}, "job spec")


def test_metrics_that_are_not_a_dict_of_names_are_refused_by_name() -> None:
    for wrong in (lambda outputs, batch: 0.5, lambda outputs, batch: {"loss": 0.5}):
        with pytest.raises(TypeError, match="must return a dict of names .other than 'loss'"):
            measured(wrong, None, None)


class ReadsAValue(torch.nn.Module):
    """A forward that reads a tensor's value: it cannot run on shapes alone."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3 * 8 * 8, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        scale = float(images.abs().max().item())
        return self.linear(images.flatten(1)) / scale


def reads_a_value() -> torch.nn.Module:
    return ReadsAValue()


def test_a_modules_flops_are_counted_on_one_sample_or_not_reported() -> None:
    spec = parse_spec(vision_job("ddp", 2))
    dataset = build_dataset(spec)
    # 2 x multiply-adds of the two 3x3 convolutions (4 channels at 8x8, 8 at 4x4) and the
    # classifier (32 -> 10), forward; training is three forwards' worth.
    forward = 2 * (4 * 8 * 8 * 3 * 9 + 8 * 4 * 4 * 4 * 9 + 32 * 10)
    assert module_flops_per_sample(spec.model, dataset) == 3 * forward
    unreadable = spec.model.model_copy(update={"factory": f"{__name__}:reads_a_value", "options": {}})
    assert module_flops_per_sample(unreadable, dataset) is None


class CountedStream(SkippingImageStream):
    """A skipping stream that counts the samples it yields."""

    yielded = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for sample in super().__iter__():
            CountedStream.yielded += 1
            yield sample

    def skip(self, n: int) -> CountedStream:
        return CountedStream(self.start + n, **self.images)


def test_a_streams_flops_are_counted_without_moving_where_a_resumed_run_reads() -> None:
    """The FLOPs are counted on a first sample read from a stream of its own: a run resumed at
    position 600 then opens its stream there with skip(), not by reading the 600 before it."""
    spec = parse_spec(vision_job("ddp", 2))
    images = {"num_samples": 1000, "size": 8, "seed": 3}
    stream = UserStream(lambda: CountedStream(**images))
    assert module_flops_per_sample(spec.model, stream) == module_flops_per_sample(spec.model, build_dataset(spec))
    CountedStream.yielded = 0
    assert torch.equal(stream.batch(torch.tensor([600, 601]))[0], SyntheticImages(**images).images[[600, 601]])
    assert CountedStream.yielded == 2
