"""Bring your own model: Hugging Face causal LMs (a Llama with grouped-query attention, GPT-2
with tied embeddings, a Mixtral mixture of experts), built from a config or read from a model
directory, and a user's module
from a factory, under the data-parallel and sharding strategies; against the same oracle as the
reference GPT (test_strategies.py): the same model, data and global batch in one process, plain
SGD without clipping, world size 2 with accumulation 2.

Also: a model directory's pretrained weights are what training starts from; a trained run exports
to a directory `AutoModelForCausalLM.from_pretrained` loads with equal logits; a checkpoint
resumes at another world size; bad model sections are refused before anything starts.
"""

from __future__ import annotations

import math
import re
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardyard.cli import main as shardyard
from shardyard.localdist import run_distributed
from shardyard.models import build_for_job, build_model
from shardyard.spec import SpecError, load_spec, parse_spec
from shardyard.checkpoint.layout import read_spec
from shardyard.checkpoint.loaders import committed_record, find_latest, load_model
from shardyard.checkpoint.pretrained import pretrained_weights
from shardyard.checkpoint.record import checkpoint_name
from shardyard.train.metrics import read_metrics
from shardyard.train.trainer import Trainer
from helpers.oracle import PARAM_TOL, train
from helpers.models import LLAMA, MIXTRAL, MODELS, SGD, STEPS, job, oracle, save_llama
from helpers.repo import REPO

STRATEGIES = {
    "ddp": {"strategy": "ddp"},
    "fsdp-ac": {"strategy": "fsdp", "activation_checkpointing": True},
    "zero2": {"strategy": "zero2"},
    "zero3": {"strategy": "zero3"},
    "tensor": {"strategy": "tensor", "tp": 2},  # the model's own base_model_tp_plan
    "fsdp-tp": {"strategy": "fsdp", "tp": 2},
    "pipeline": {"strategy": "pipeline", "pp": 2, "schedule": "1f1b"},  # its base_model_pp_plan
}
# GPT-2 has neither plan (and ties its head to its embedding).
CASES = ([(m, s) for m in ("llama", "gpt2") for s in STRATEGIES
          if s != "fsdp-tp" and (m, s) not in (("gpt2", "tensor"), ("gpt2", "pipeline"))]
         + [("qwen3", "tensor"), ("qwen3", "fsdp-tp"), ("olmo2", "tensor"), ("mixtral", "fsdp-ac"),
            ("mixtral", "zero3"), ("mixtral", "tensor"), ("mixtral", "fsdp-tp"), ("qwen3_moe", "tensor"),
            ("llama4", "tensor")]
         + [("custom", "ddp"), ("custom", "fsdp-ac"), ("custom-hooks", "tensor"), ("custom-hooks", "pipeline")])


def every_case(rank: int, world: int, out: str) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for model, strategy in CASES:
        try:
            train(rank, world, job(MODELS[model], STRATEGIES[strategy], world, Path(out, model, strategy)))
            results[f"{model}/{strategy}"] = None
        except Exception:  # noqa: BLE001 - reported by the case's own test
            results[f"{model}/{strategy}"] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None]]:
    out = tmp_path_factory.mktemp("models")
    return out, run_distributed(every_case, 2, str(out))[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, strategy", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_model_under_strategy_matches_single_process(model: str, strategy: str, trained) -> None:
    out, results = trained
    error = results[f"{model}/{strategy}"]
    assert error is None, f"{model} under {strategy} raised on rank 0:\n{error}"
    initial, expected = oracle(model)
    assert max((expected[k] - initial[k]).abs().max().item() for k in initial) > 100 * PARAM_TOL
    final = find_latest(out / model / strategy / "run")
    assert final.name == checkpoint_name(STEPS)
    # A custom module's factory is imported only when the reader names it (the test trusts its own).
    got = load_model(final, trust_factory=getattr(read_spec(final).model, "factory", None)).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=f"{model}/{strategy}: {name}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_export_to_a_directory_transformers_loads_with_equal_logits(model: str, trained, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out, results = trained
    assert results[f"{model}/fsdp-ac"] is None, results[f"{model}/fsdp-ac"]
    run_dir = out / model / "fsdp-ac" / "run"
    assert shardyard(["export", str(run_dir), "--format", "hf", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained_model = load_model(find_latest(run_dir))
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(exported(input_ids=tokens).logits, trained_model(tokens), rtol=0, atol=1e-6)
    # A run on prepared data keeps its data's tokenizer; the export carries that one.
    from transformers import AutoTokenizer

    from shardyard.data.tokenizer import train_bpe

    _, tokenizer = train_bpe(iter(["def f(x): return x\n"] * 20), vocab_size=270)
    tokenizer.save_pretrained(tmp_path / "bpe")
    shutil.copytree(tmp_path / "bpe", run_dir / "tokenizer")
    try:
        assert shardyard(["export", str(run_dir), "--format", "hf", str(tmp_path / "with_bpe")]) == 0
    finally:
        shutil.rmtree(run_dir / "tokenizer")
    assert (tmp_path / "with_bpe" / "tokenizer.json").read_bytes() == (tmp_path / "bpe" / "tokenizer.json").read_bytes()
    assert len(AutoTokenizer.from_pretrained(tmp_path / "with_bpe")) == len(tokenizer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_random_initialisation_is_drawn_one_unit_at_a_time(model: str) -> None:
    """Under a strategy that shards the model, a config's weights are drawn one unit (a decoder
    layer, an embedding, the head) at a time, each far smaller than the model; a pipeline stage
    that draws only its own layers gets what drawing the whole model gives them."""
    from shardyard.models import materialise
    from shardyard.models.initial_weights import initial_values

    spec = parse_spec(job(MODELS[model], {"strategy": "fsdp"}, 2))
    torch.manual_seed(spec.run.seed)
    shapes = build_for_job(spec)
    assert all(p.is_meta for p in shapes.parameters())
    torch.manual_seed(spec.run.seed)
    whole = build_model(spec.model).state_dict()
    largest = max(sum(t.numel() for t in unit.values()) for unit in initial_values(shapes))
    assert largest < sum(p.numel() for p in shapes.parameters()) / 2
    if model == "llama":  # GPT-2 has no pipeline plan
        stage = materialise(shapes.pipeline_stage(1, 2), torch.device("cpu")).state_dict()
        assert any(".layers.1." in name for name in stage) and not any(".layers.0." in name for name in stage)
        for name, value in stage.items():
            torch.testing.assert_close(value, whole[name], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(300)
def test_training_starts_from_a_model_directory_and_resumes_at_another_world_size(tmp_path: Path) -> None:
    """A directory saved with `save_pretrained`: its weights are loaded; a run at 2 ranks stopped
    after step 2 resumes at 1 (FSDP through DCP) and ends where one process ends."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)  # other weights than the spec's seed would make
    save_llama(tmp_path / "llama")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").state_dict()
    pretrained = {"name": "hf", "path": str(tmp_path / "llama"), "block_size": 16}
    model_spec = parse_spec(job(pretrained, {"strategy": "ddp"}, 1)).model
    built = build_model(model_spec, pretrained_weights(model_spec)).state_dict()
    for name, value in saved.items():
        torch.testing.assert_close(built[f"hf.{name}"], value, rtol=0, atol=0, msg=name)

    elastic = job(pretrained, {"strategy": "fsdp"}, 2, tmp_path / "runs", steps_=4)
    elastic["scaling"] = {"min_workers": 1, "max_workers": 2}
    # Under FSDP the model is built without weights; each rank then reads only its shards.
    assert all(p.is_meta for p in build_for_job(parse_spec(elastic)).parameters())
    run_distributed(train, 2, elastic, 2)
    run_distributed(train, 1, elastic)
    final = find_latest(tmp_path / "runs" / "run")
    assert committed_record(final)["world_size"] == 1

    MODELS["pretrained"] = pretrained
    try:
        _, expected = oracle("pretrained", 4)
    finally:
        del MODELS["pretrained"]
    got = load_model(final).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=name)


@pytest.mark.timeout(300)
def test_experts_resume_from_plain_shards_into_packed_slices_and_back(tmp_path: Path) -> None:
    """Mixtral with momentum: steps 1-2 under FSDP (each expert tensor split by experts), steps 3-4
    resumed from that checkpoint under tensor parallelism (the packed gate/up projections split
    into slices of both halves, which DCP stores as plain shards), equal to one process."""
    momentum = {**SGD, "momentum": 0.9}
    raw = job(MODELS["mixtral"], {"strategy": "fsdp"}, 2, tmp_path / "runs", steps_=4, optim=momentum)
    run_distributed(train, 2, raw, 2)
    run_distributed(train, 2, raw | {"parallelism": STRATEGIES["tensor"]})
    final = find_latest(tmp_path / "runs" / "run")
    assert final.name == checkpoint_name(4)
    _, expected = oracle("mixtral", 4, momentum)
    got = load_model(final).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, parallelism", [
    ("llama", {"strategy": "fsdp", "tp": 2}), ("llama", {"strategy": "tensor", "tp": 2}),
    ("llama", {"strategy": "pipeline", "pp": 2}), ("llama", {"strategy": "zero3"}),
    ("mixtral", {"strategy": "fsdp", "tp": 2})], ids=["fsdp-x-tensor", "tensor", "pipeline", "zero3", "mixtral"])
def test_a_model_directory_loads_shard_by_shard(tmp_path: Path, model: str, parallelism: dict) -> None:
    """Built on the meta device, sharded over a (dp 1, tp 2) mesh or split into 2 stages, then
    each rank reads only its slices or layers of the safetensors files: training from there equals
    one process trained from the directory. Mixtral's files keep each expert's projections apart
    (transformers packs them into 3-D parameters as it loads)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(12)
    config = MODELS[model]["config"]
    keys = {k: v for k, v in config.items() if k != "architecture"}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config["architecture"], **keys)).save_pretrained(
        tmp_path / model)
    MODELS["pretrained"] = {"name": "hf", "path": str(tmp_path / model), "block_size": 16}
    try:
        spec = job(MODELS["pretrained"], parallelism, 2, tmp_path / "runs")
        assert all(p.is_meta for p in build_for_job(parse_spec(spec)).parameters())
        run_distributed(train, 2, spec)
        initial, expected = oracle("pretrained")
    finally:
        del MODELS["pretrained"]
    assert max((expected[k] - initial[k]).abs().max().item() for k in initial) > 100 * PARAM_TOL
    got = load_model(find_latest(tmp_path / "runs" / "run")).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=PARAM_TOL, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model, expected", [
    ({"name": "hf"}, "needs model.path (a model directory) or model.config"),
    ({"name": "hf", "path": "/nonexistent"}, "not a Hugging Face model directory"),
    ({"name": "hf", "config": {"hidden_size": 32}}, "needs `architecture`"),
    ({"name": "hf", "config": {"architecture": "nonesuch"}}, "not a model type transformers knows"),
    ({"name": "hf", "config": {**LLAMA, "hidden_size": 30}}, "transformers refused it"),
    ({"name": "hf", "config": LLAMA, "block_size": 128}, "exceeds the model's max_position_embeddings (64)"),
    ({"name": "custom", "factory": "custom_model"}, "must be 'package.module:function'"),
    ({"name": "custom", "factory": "no_such_package:build"}, "cannot import 'no_such_package'"),
    ({"name": "custom", "factory": "custom_model:nothing"}, "has no function 'nothing'"),
])
def test_bad_model_sections_are_refused_with_the_reason(model: dict, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(job(model, {"strategy": "ddp"}, 1))
    assert expected in str(err.value)


# Models whose plans shardyard cannot apply: multi-head latent attention's style, experts whose
# hidden features do not split evenly, custom plans naming what no block has or unknown styles.
REFUSED_MODELS = {"deepseek_v2": {"name": "hf", "config": {**LLAMA, "architecture": "deepseek_v2"}, "block_size": 16},
                  "mixtral-45": {"name": "hf", "config": {**MIXTRAL, "intermediate_size": 45}, "block_size": 16},
                  "custom-typo": {**MODELS["custom-hooks"], "options": {"tp_plan": {"up": "colwise", "dwn": "rowwise"}}},
                  "custom-style": {**MODELS["custom-hooks"], "options": {"tp_plan": {"up": "sideways"}}}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model, parallelism, expected", [
    ("gpt2", {"strategy": "tensor", "tp": 2}, "model 'gpt2' ships no tensor-parallel plan"),
    ("gpt2", {"strategy": "pipeline", "pp": 2}, "model 'gpt2' ships no pipeline plan"),
    ("custom", {"strategy": "tensor", "tp": 2}, "(TinyLM) has no tensor-parallel plan: give it block_tp_plan"),
    ("custom", {"strategy": "pipeline", "pp": 2}, "(TinyLM) does not say how to split it into pipeline stages"),
    ("custom-typo", {"strategy": "tensor", "tp": 2}, "block_tp_plan names ['dwn'], which no block"),
    ("custom-style", {"strategy": "tensor", "tp": 2}, "block_tp_plan uses ['sideways']; shardyard applies"),
    ("llama", {"strategy": "tensor", "tp": 4}, "num_key_value_heads (2) must be divisible by parallelism.tp (4)"),
    ("llama", {"strategy": "pipeline", "pp": 4}, "the model's 2 blocks cannot be split into 4 pipeline stages"),
    ("deepseek_v2", {"strategy": "tensor", "tp": 2},
     "model 'deepseek_v2': its tensor-parallel plan uses ['mla_kv_a_proj']"),
    ("mixtral-45", {"strategy": "tensor", "tp": 2}, "model.config intermediate_size (45) must be divisible by "
                                                    "parallelism.tp (2)"),
])
def test_parallelism_a_model_does_not_support_is_refused_with_the_reason(model: str, parallelism: dict,
                                                                          expected: str) -> None:
    world = parallelism.get("tp", 1) * parallelism.get("pp", 1)
    raw = job(MODELS.get(model) or REFUSED_MODELS[model], parallelism, world)
    if model == "mixtral-45" and not experts_sharded(raw["model"]):
        # transformers 5.25's Mixtral plan shards attention only: every rank keeps whole experts,
        # so their width needs no dividing, and the spec is accepted.
        assert parse_spec(raw).parallelism.tp == 2
        return
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert expected in str(err.value)


def experts_sharded(model: dict) -> bool:
    """Whether this transformers' tensor-parallel plan for the model splits its experts."""
    from shardyard.spec import HFSpec

    return "moe_tp_experts" in (HFSpec.model_validate(model).hf_config().base_model_tp_plan or {}).values()


@pytest.mark.timeout(120)
def test_a_model_directory_with_a_tokenizer_has_its_text_tokenized_with_it(tmp_path: Path) -> None:
    """Training reads the corpus as the tokenizer's ids (not bytes), and serving encodes prompts,
    decodes answers and streams text piece by piece with the same tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from shardyard.data import build_dataset
    from shardyard.serve.generation import TextCodec, TextStream

    text = "def add(x, y):\n    return x + y\n\n# naïve café: déjà vu\n" * 40
    (tmp_path / "corpus.txt").write_text(text)
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator([text], vocab_size=300, min_frequency=2, show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)
    keys = {k: v for k, v in LLAMA.items() if k != "architecture"} | {"vocab_size": len(tokenizer)}
    model_dir = tmp_path / "llama"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **keys)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    raw = job({"name": "hf", "path": str(model_dir), "block_size": 16}, {"strategy": "ddp"}, 1)
    raw["data"] = {"name": "corpus", "path": str(tmp_path / "corpus.txt")}
    spec = parse_spec(raw)
    assert spec.model.brings_tokenizer and spec.model.vocab_size == len(tokenizer)
    dataset = build_dataset(spec)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(text.encode()) // 2  # merges learned: far fewer tokens than bytes
    inputs, targets = dataset.batch(torch.tensor([0, 3]))
    assert inputs[1].tolist() == ids[48:64] and targets[1].tolist() == ids[49:65]

    codec = TextCodec(tokenizer)
    prompt = "# naïve café"
    assert codec.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
    assert codec.decode(codec.encode(prompt)) == prompt
    stream = TextStream(codec)
    pieces = [stream.push(token) for token in codec.encode(text[:200])] + [stream.finish()]
    assert "".join(pieces) == text[:200] and "\ufffd" not in "".join(pieces)


@pytest.mark.timeout(120)
def test_streamed_text_is_the_whole_decode_from_windows_of_the_newest_tokens() -> None:
    """Streamed text, piece by piece, equals the whole sequence decoded at once, for UTF-8 bytes
    (characters split over tokens, bytes that never complete one), a byte-level BPE and a
    SentencePiece-style tokenizer (which drops a text's leading space); and each token decodes a
    few tokens, not the whole answer again (a 2,000-token answer: half a second of decoding)."""
    import random

    from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from shardyard.serve.generation import TextCodec, TextStream

    text = "def add(x, y):\n    return x + y\n\n# naïve café: déjà vu 🙂\n" * 40
    codecs = [TextCodec()]
    for kind in (ByteLevelBPETokenizer, SentencePieceBPETokenizer):
        trained = kind()
        trained.train_from_iterator([text], vocab_size=250, min_frequency=2, show_progress=False)
        codecs.append(TextCodec(PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer)))
    rng = random.Random(0)
    for codec in codecs:
        vocab = 256 if codec.tokenizer is None else len(codec.tokenizer)
        for _ in range(60):
            tokens = [rng.choice([rng.randrange(vocab), 0xE2, 0x82, 0xAC, 0xC3]) for _ in range(rng.randrange(1, 80))]
            stream = TextStream(codec)
            assert "".join(stream.push(t) for t in tokens) + stream.finish() == codec.decode(tokens), tokens

    class Counted(TextCodec):
        decoded = 0

        def decode(self, tokens) -> str:
            Counted.decoded += len(tokens)
            return super().decode(tokens)

    stream, answer = TextStream(Counted()), text.encode()[:2000]
    assert "".join(stream.push(t) for t in answer) + stream.finish() == answer.decode()
    assert Counted.decoded < 10 * len(answer), Counted.decoded


def documented_shrink() -> list[str]:
    """The `--set` overrides docs/models.md gives to train the real model shapes on a CPU."""
    text = (REPO / "docs" / "models.md").read_text()
    command = text[text.index("shardyard train jobs/configs/llama3_8b_fsdp.yaml \\"):]
    return re.findall(r"--set (\S+)", command[:command.index("```")])


def train_config(rank: int, world: int, config: str, overrides: list[str]) -> None:
    Trainer.build(load_spec(config, overrides), rank, world, torch.device("cpu")).train()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config, architecture", [("llama3_8b_fsdp", "LlamaForCausalLM"),
                                                  ("qwen2_5_7b_fsdp_tp", "Qwen2ForCausalLM")])
def test_a_real_model_config_shrunk_as_the_docs_say_trains_on_a_cpu(config: str, architecture: str,
                                                                   tmp_path: Path) -> None:
    """The Llama-3-8B and Qwen2.5-7B configs, shrunk by the docs' --set lines, keep their
    architecture, attention layout, parallelism and optimizer and train on 4 CPU ranks (FSDP over
    4; FSDP x TP as a 2 x 2 mesh)."""
    path = str(REPO / "jobs" / "configs" / f"{config}.yaml")
    full = load_spec(path)
    overrides = [*documented_shrink(), f"checkpoint.storage_path={tmp_path}", "run.log_every=1"]
    shrunk = load_spec(path, overrides)
    assert shrunk.parallelism == full.parallelism and shrunk.model.config["architecture"] == full.model.config["architecture"]
    assert shrunk.optim.name == full.optim.name and shrunk.model.config["rope_theta"] == full.model.config["rope_theta"]
    run_distributed(train_config, 4, path, overrides)
    rows = read_metrics(tmp_path / shrunk.run.name)
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(math.isfinite(r["loss"]) for r in rows)
    assert type(load_model(find_latest(tmp_path / shrunk.run.name)).hf).__name__ == architecture
