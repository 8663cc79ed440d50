"""`shardyard export CHECKPOINT_OR_RUN OUT`: a checkpoint of any strategy as one safetensors file, or a
Hugging Face model's as a directory transformers loads."""

from __future__ import annotations

import argparse
import sys

from shardyard import exit_codes
from shardyard.spec import SpecError

HELP = "checkpoint -> one safetensors state_dict file, or a Hugging Face model directory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    parser.add_argument("out", help="output .safetensors path (--format hf: a directory)")
    parser.add_argument("--format", dest="fmt", choices=("safetensors", "hf"), default="safetensors",
                        help="hf: config.json, safetensors weights and tokenizer files, for "
                             "AutoModelForCausalLM.from_pretrained (model.name 'hf' runs)")
    parser.add_argument("--trust-factory", metavar="MODULE:FUNCTION",
                        help="a custom model's factory, to import for a checkpoint that names it (a "
                             "factory named by a file in the run directory is never imported unasked)")


def run(args: argparse.Namespace) -> int:
    return run_export(args.checkpoint, args.out, args.fmt, args.trust_factory)


def run_export(checkpoint: str, out: str, fmt: str, trust_factory: str | None = None) -> int:
    """Write a checkpoint of any strategy (or a run directory's newest good one) as one
    safetensors file, or, for a Hugging Face model, as a model directory transformers loads. A bad
    checkpoint is named, never loaded; a run directory falls back to its previous good one."""
    from shardyard.checkpoint.layout import read_spec
    from shardyard.checkpoint.loaders import export_safetensors, load_model, servable
    from shardyard.checkpoint.record import BadCheckpoint

    try:
        path = servable(checkpoint)
        if path is None:
            print(f"shardyard: {checkpoint!r} is neither a committed checkpoint nor a run directory with one "
                  f"(`shardyard train` writes them)", file=sys.stderr)
            return exit_codes.REFUSED
        if fmt == "safetensors":
            print(export_safetensors(path, out, trust_factory))
            return exit_codes.DONE
        model_name = read_spec(path).model.name
        if model_name != "hf":
            print(f"shardyard: --format hf writes Hugging Face models; {checkpoint!r} holds model.name "
                  f"'{model_name}' (use --format safetensors)", file=sys.stderr)
            return exit_codes.REFUSED
        from shardyard.data.shards import TOKENIZER_DIR
        from shardyard.models.hf import export_hf_directory

        run_tokenizer = path.parent / TOKENIZER_DIR  # the tokenizer the run's prepared data used, if any
        print(export_hf_directory(load_model(path, verify=False), out,
                                  run_tokenizer if run_tokenizer.is_dir() else None))
        return exit_codes.DONE
    except (BadCheckpoint, SpecError) as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.REFUSED
