"""The recipes as drop-ins for transformers' accelerate examples: a `run_*_no_trainer.py` command
line runs unchanged on the recipe that stands in for it, trains the same job, and leaves the
example's files (`all_results.json`) beside the recipe's own.

    accelerate launch recipes/bert_glue.py --model_name_or_path bert-base-cased --task_name mrpc \\
        --max_length 128 --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 \\
        --output_dir /tmp/mrpc/                     # text-classification/run_glue_no_trainer.py's README

FLAGS holds every flag of the four examples' parsers and what it is here: the recipe's own flag of
the same name and meaning (`same`), another name for one of the recipe's flags (`alias`), a flag
the recipes take for the examples' sake (`accepted`), or one they refuse in one sentence that says
what to use instead (`refused`). scripts/no_trainer_flags.py reads the examples' source and names
every flag the table lacks; the test suite checks the table against the recipes' parsers and a
snapshot of the examples' flags (tests/data/no_trainer/flags.json). docs/migrating.md is the
table in words, with the defaults that differ and `--hf_example_defaults`, which takes the
examples' own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

# The example each recipe stands in for, under transformers' examples/pytorch.
EXAMPLES = {
    "bert_glue": "text-classification/run_glue_no_trainer.py",
    "bert_ner": "token-classification/run_ner_no_trainer.py",
    "bert_qa": "question-answering/run_qa_no_trainer.py",
    "bert_mlm": "language-modeling/run_mlm_no_trainer.py",
}
ALL = tuple(EXAMPLES)
# The project (W&B) and TensorBoard folder the examples' --with_tracking logs to.
TRACKING_PROJECTS = {"bert_glue": "glue", "bert_ner": "ner", "bert_qa": "qa", "bert_mlm": "mlm"}


@dataclass(frozen=True)
class Flag:
    """One flag of the examples' parsers: which examples have it (by recipe), what it is here."""

    examples: tuple[str, ...]
    how: str  # same, alias, accepted, refused
    note: str  # what it does in the recipes (docs/migrating.md's table)
    target: str | None = None  # alias: the recipes' own flag


def _same(examples, note=""):
    return Flag(tuple(examples), "same", note)


FLAGS = {
    "--task_name": Flag(
        ("bert_glue", "bert_ner"),
        "same",
        "GLUE: the task (its files from --data_dir, else the Hub). NER: ner or chunk picks the tags "
        "column `<task>_tags` when --label_column_name is not given; pos is refused (part-of-speech "
        "tags are not entity spans, which the recipe learns and scores)",
    ),
    "--dataset_name": _same(
        ("bert_ner", "bert_qa", "bert_mlm"),
        "a Hub dataset, in every recipe (GLUE too); offline, one sentence saying to give files",
    ),
    "--dataset_config_name": _same(("bert_ner", "bert_qa", "bert_mlm"), "the Hub dataset's configuration"),
    "--train_file": _same(ALL),
    "--validation_file": _same(ALL),
    "--test_file": _same(("bert_qa",)),
    "--max_length": Flag(("bert_glue", "bert_ner"), "alias", "", "--max_seq_length"),
    "--max_seq_length": _same(
        ("bert_qa", "bert_mlm"), "MLM: 128 here; the example: the model's, at most 1024"
    ),
    "--pad_to_max_length": Flag(
        ALL, "accepted", "pad every batch to --max_seq_length (default: each batch to its longest row)"
    ),
    "--model_name_or_path": _same(ALL, "default bert-base-uncased (the GLUE example requires it)"),
    "--config_name": _same(("bert_ner", "bert_qa", "bert_mlm"), "the config to load, if not the model's"),
    "--tokenizer_name": _same(
        ("bert_ner", "bert_qa", "bert_mlm"), "the tokenizer to load, if not the model's"
    ),
    "--use_slow_tokenizer": Flag(
        ("bert_glue", "bert_qa", "bert_mlm"),
        "accepted",
        "passed as use_fast=False; transformers 5 loads the fast tokenizer anyway (a warning says so)",
    ),
    "--model_type": Flag(
        ("bert_ner", "bert_qa", "bert_mlm"),
        "refused",
        "trains a model from random weights; the recipes fine-tune a pretrained one",
    ),
    "--per_device_train_batch_size": _same(ALL, "default 32 (the examples: 8)"),
    "--per_device_eval_batch_size": _same(ALL, "default 128 (the examples: 8)"),
    "--learning_rate": _same(ALL, "default 2e-5, masked LM 5e-5 (the examples: 5e-5)"),
    "--weight_decay": _same(ALL, "default 0.01 (the examples: 0), never on biases and norms"),
    "--num_train_epochs": _same(ALL, "default 3, masked LM 1 (the examples: 3)"),
    "--max_train_steps": _same(ALL),
    "--gradient_accumulation_steps": _same(
        ALL, "accelerator.accumulate (the GLUE and NER examples step after the first micro-batch)"
    ),
    "--lr_scheduler_type": _same(ALL, "transformers' schedules; `constant` ignores the warm-up, as there"),
    "--num_warmup_steps": _same(ALL, "default: --warmup_ratio 0.1 of the steps (the examples: 0)"),
    "--output_dir": _same(ALL, "default outputs/<task> (the examples save nothing without it)"),
    "--seed": _same(ALL, "default 42 (the examples: unseeded)"),
    "--push_to_hub": _same(ALL),
    "--hub_model_id": _same(ALL),
    "--hub_token": _same(ALL),
    "--trust_remote_code": Flag(
        ALL,
        "accepted",
        "off unless given; passed to transformers' from_pretrained (`--trust_remote_code` or "
        "`--trust_remote_code true`); datasets 4 and newer run no loading scripts at all",
    ),
    "--checkpointing_steps": _same(
        ALL,
        "N or epoch; <output_dir>/step_<n> or epoch_<i> as there (the checkpoint also in checkpoints/checkpoint-<step>)",
    ),
    "--resume_from_checkpoint": _same(
        ALL,
        "a checkpoint, `latest`, or a folder the example saved (epoch_<i>, step_<n>); an empty value "
        "resumes nothing, as there",
    ),
    "--with_tracking": Flag(
        ALL,
        "accepted",
        "trackers on: --report_to's, else every installed one (`all`), under the project <task>_no_trainer",
    ),
    "--report_to": _same(
        ALL,
        "none (default), all, or one of accelerate's trackers; a tracker not installed is refused "
        "in one sentence. Without --with_tracking it still turns trackers on here",
    ),
    "--ignore_mismatched_sizes": _same(("bert_glue", "bert_ner")),
    "--text_column_name": Flag(("bert_ner",), "alias", "", "--tokens_column"),
    "--label_column_name": Flag(("bert_ner",), "alias", "", "--tags_column"),
    "--label_all_tokens": _same(("bert_ner",), "every sub-token of a word trains, B-X becoming I-X"),
    "--return_entity_level_metrics": Flag(
        ("bert_ner",),
        "accepted",
        "all_results.json gets each entity type's scores and the overall ones as eval_overall_*; "
        "eval_results.json always has them",
    ),
    "--debug": Flag(("bert_ner",), "accepted", "the first 100 sentences of each split"),
    "--preprocessing_num_workers": _same(("bert_qa", "bert_mlm")),
    "--do_predict": _same(("bert_qa",)),
    "--doc_stride": _same(("bert_qa",)),
    "--n_best_size": _same(("bert_qa",)),
    "--null_score_diff_threshold": _same(("bert_qa",)),
    "--version_2_with_negative": _same(("bert_qa",)),
    "--max_answer_length": _same(("bert_qa",)),
    "--max_train_samples": _same(("bert_qa",)),
    "--max_eval_samples": _same(("bert_qa",)),
    "--max_predict_samples": Flag(("bert_qa",), "accepted", "the first N questions of --test_file"),
    "--overwrite_cache": Flag(
        ("bert_qa", "bert_mlm"), "accepted", "tokenise again instead of reading datasets' cache"
    ),
    "--validation_split_percentage": _same(("bert_mlm",)),
    "--line_by_line": Flag(
        ("bert_mlm",),
        "accepted",
        "one sequence per non-empty line, not the text concatenated and cut; `--line_by_line` or "
        "`--line_by_line true` (the example reads any value, `false` too, as true)",
    ),
    "--mlm_probability": _same(("bert_mlm",)),
}

# The examples' defaults where they differ from the recipes' (--hf_example_defaults takes them for
# every flag not given on the command line). `max_grad_norm` 0: the examples do not clip; `seed`
# None: the examples seed nothing (here a seed is drawn, and recorded, since the recipes' resume
# and paired runs need one).
EXAMPLE_DEFAULTS = {
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 8,
    "learning_rate": 5e-5,
    "weight_decay": 0.0,
    "num_warmup_steps": 0,
    "max_grad_norm": 0.0,
    "seed": None,
}
EXAMPLE_RECIPE_DEFAULTS = {
    "bert_glue": {"group_by_length": False},  # the examples shuffle; the recipe batches by length
    "bert_ner": {},
    "bert_qa": {},
    "bert_mlm": {"max_seq_length": None, "num_train_epochs": 3},  # the recipe's own: 128 tokens, 1 epoch
}
MLM_LONGEST = 1024  # the MLM example's cap on the model's own maximum length
DEBUG_ROWS = 100  # the NER example's --debug

# accelerate's trackers (LoggerType), and the package each needs.
TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "comet_ml": "comet_ml",
    "clearml": "clearml",
    "mlflow": "mlflow",
    "aim": "aim",
    "dvclive": "dvclive",
    "swanlab": "swanlab",
    "trackio": "trackio",
}


def truthy(value: str) -> bool:
    """A flag's written value: true/false, yes/no, 1/0."""
    lowered = str(value).strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


class _Alias(argparse.Action):
    """Another name for a recipe's flag: its value under the flag's name; the name written is kept
    on the parser (`aliases_written`), so that an error names the flag the user typed."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        parser.aliases_written = {**getattr(parser, "aliases_written", {}), self.dest: option_string}


def add_example_args(parser: argparse.ArgumentParser, recipe: str) -> None:
    """The examples' flags the recipe does not already have, in a group of their own; the flags
    that are the recipe's own (`same`) are not touched."""
    group = parser.add_argument_group("transformers no_trainer examples (docs/migrating.md)")
    for flag, row in FLAGS.items():
        if recipe not in row.examples or _has(parser, flag) or row.how == "same":
            continue
        if row.how == "alias":
            target = parser._option_string_actions[row.target]  # its value, parsed as the target parses it
            group.add_argument(
                flag,
                dest=target.dest,
                type=target.type,
                default=argparse.SUPPRESS,
                action=_Alias,
                help=f"= {row.target}.",
            )
        elif row.how == "refused":
            group.add_argument(flag, help=f"Refused: {row.note}.")
        elif flag in ("--trust_remote_code", "--line_by_line"):
            group.add_argument(flag, nargs="?", const=True, default=False, type=truthy, help=f"{row.note}.")
        elif flag in ("--max_predict_samples",):
            group.add_argument(flag, type=int, help=f"{row.note}.")
        else:
            group.add_argument(flag, action="store_true", help=f"{row.note[0].upper()}{row.note[1:]}.")
    if recipe == "bert_ner" and not _has(parser, "--task_name"):
        group.add_argument(
            "--task_name",
            choices=["ner", "pos", "chunk"],
            default="ner",
            help="Which tags to learn: the tags column `<task>_tags` when --label_column_name is not given.",
        )
    for flag, help_text in (
        ("--dataset_name", "A Hub dataset (instead of --train_file/--validation_file)."),
        ("--dataset_config_name", "The Hub dataset's configuration."),
        ("--config_name", "The config to load, if not --model_name_or_path's."),
        ("--tokenizer_name", "The tokenizer to load, if not --model_name_or_path's."),
    ):
        if not _has(parser, flag):
            group.add_argument(flag, help=help_text)
    group.add_argument(
        "--hf_example_defaults",
        action="store_true",
        help="The transformers example's defaults for every flag not given (batch 8, learning rate 5e-5, "
        "no weight decay, no warm-up, no clipping, unseeded, the plain shuffle): its numbers, not the recipe's.",
    )


def given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags written on the command line (`--flag value` or `--flag=value`)."""
    dests = set()
    for token in argv:
        if token == "--":
            break
        action = parser._option_string_actions.get(token.split("=", 1)[0])
        if action is not None:
            dests.add(action.dest)
    return dests


def apply_example_args(parser: argparse.ArgumentParser, args: argparse.Namespace, argv, recipe: str) -> None:
    """After parsing: the examples' flags made the recipe's (one sentence for what cannot be)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    written = given(parser, argv)
    options = {token.split("=", 1)[0] for token in argv}
    for flag, row in FLAGS.items():
        if row.how == "alias" and recipe in row.examples and {flag, row.target} <= options:
            parser.error(f"{flag} and {row.target} are the same setting: give one of them.")
    args.recipe_family = recipe  # which example's all_results.json keys (all_results)
    if getattr(args, "model_type", None):
        parser.error(
            f"--model_type {args.model_type} builds a model from random weights; these recipes fine-tune a "
            "pretrained one: give --model_name_or_path (and --config_name for another configuration)."
        )
    if args.hf_example_defaults:
        for name, value in {**EXAMPLE_DEFAULTS, **EXAMPLE_RECIPE_DEFAULTS[recipe]}.items():
            if name not in written and not (name == "num_warmup_steps" and "warmup_ratio" in written):
                setattr(args, name, value)
    if args.resume_from_checkpoint == "":  # the examples: an empty value resumes nothing
        args.resume_from_checkpoint = None
    if getattr(args, "debug", False):  # the NER example's --debug: the first 100 sentences of each split
        args.max_train_samples = min(args.max_train_samples or DEBUG_ROWS, DEBUG_ROWS)
        args.max_eval_samples = min(args.max_eval_samples or DEBUG_ROWS, DEBUG_ROWS)
    if args.with_tracking and "report_to" not in written:
        args.report_to = "all"
    if args.with_tracking and "project_name" not in written:
        args.project_name = f"{TRACKING_PROJECTS[recipe]}_no_trainer"
    missing = TRACKERS.get(args.report_to)
    if missing and not _importable(missing):
        parser.error(f"--report_to {args.report_to} needs the {missing} package: pip install {missing}.")


def settle_seed(accelerator, args, checkpoints_dir: Path) -> None:
    """--seed unset (the examples' unseeded run, --hf_example_defaults): a seed for the whole
    launch, recorded like any other. Resumed, the checkpoint's (it must match); else drawn on the
    main process and sent to the others, whose shuffles and shards must agree."""
    if args.seed is not None:
        return
    from accelerate.logging import get_logger
    from accelerate.utils import broadcast_object_list

    from . import checkpoint  # not at the top: checkpoint imports this module

    logger = get_logger(__name__)

    if args.resume_from_checkpoint:
        try:
            found = checkpoint.resolve_checkpoint(args.resume_from_checkpoint, checkpoints_dir)
            args.seed = json.loads((found / checkpoint.MARKER).read_text()).get("seed")
        except (checkpoint.CheckpointError, OSError, ValueError):
            pass  # not one of the recipe's complete checkpoints: the resume itself says what is wrong
        if args.seed is not None:
            logger.info(f"--seed not given: {args.seed}, the checkpoint's.", main_process_only=True)
            return
    drawn = [random.SystemRandom().randrange(2**32) if accelerator.is_main_process else None]
    if accelerator.num_processes > 1:
        broadcast_object_list(drawn)
    args.seed = drawn[0]
    logger.info(
        f"--seed not given: {args.seed}, drawn for this run (--seed {args.seed} repeats it; a resume takes it "
        "from the checkpoint).",
        main_process_only=True,
    )


def _importable(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def flag_table() -> str:
    """FLAGS as docs/migrating.md shows it (a test keeps the page equal to this)."""
    short = {"bert_glue": "glue", "bert_ner": "ner", "bert_qa": "qa", "bert_mlm": "mlm"}
    lines = ["| flag | examples | here | what it does in the recipes |", "|---|---|---|---|"]
    for flag, row in FLAGS.items():
        how = f"alias of `{row.target}`" if row.how == "alias" else row.how
        lines.append(f"| `{flag}` | {', '.join(short[e] for e in row.examples)} | {how} | {row.note} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- loading
def tokenizer_kwargs(args) -> dict:
    """from_pretrained's settings for the tokenizer: remote code only when asked; the slow tokenizer
    when asked, which transformers 5 no longer has (it loads the fast one: the log says so)."""
    kwargs = {"trust_remote_code": args.trust_remote_code}
    if getattr(args, "use_slow_tokenizer", False):
        from accelerate.logging import get_logger

        get_logger(__name__).warning(
            "--use_slow_tokenizer: transformers 5 loads the fast tokenizer whatever use_fast says.",
            main_process_only=True,
        )
        kwargs["use_fast"] = False
    return kwargs


def max_seq_length(args, tokenizer) -> int:
    """--max_seq_length, or (None: --hf_example_defaults for the masked LM) the tokenizer's own
    maximum, at most 1024, as the MLM example takes it."""
    if args.max_seq_length is not None:
        return args.max_seq_length
    return min(tokenizer.model_max_length, MLM_LONGEST)


# ----------------------------------------------------------------------------- all_results.json
def all_results(summary: dict, args) -> dict:
    """The example's all_results.json from the run's summary: the same numbers as eval_results.json,
    under the example's keys."""
    recipe = args.recipe_family
    scores = {
        name: value
        for name, value in summary.items()
        if name.startswith("eval_")
        and isinstance(value, (int, float))
        and not name.startswith(("eval_samples", "eval_windows", "eval_truncated"))
    }
    if recipe == "bert_mlm":
        return {"perplexity": summary.get("eval_perplexity")}
    if recipe == "bert_ner":
        overall = ("precision", "recall", "f1", "accuracy")
        if args.return_entity_level_metrics:
            results = {
                (f"eval_overall_{name[5:]}" if name[5:] in overall else name): value
                for name, value in scores.items()
            }
        else:
            results = {f"eval_{name}": scores[f"eval_{name}"] for name in overall if f"eval_{name}" in scores}
        if summary.get("train_loss") is not None:
            results["train_loss"] = summary["train_loss"]
        return results
    return scores


def write_all_results(output_dir, results: dict) -> None:
    """all_results.json, as the examples write it (plain JSON, numbers as numbers)."""
    from .records import write_text_atomic

    write_text_atomic(os.path.join(output_dir, "all_results.json"), json.dumps(results))


# ----------------------------------------------------------------------------- their checkpoints
def example_checkpoint(path: Path) -> tuple[str, int] | None:
    """("epoch", i) or ("step", n) for a folder the examples' --checkpointing_steps wrote with
    accelerator.save_state (`epoch_<i>`, `step_<n>`, holding the model and the optimizer's state);
    None for a folder not so named. One so named in a layout the recipe cannot load (FSDP's or
    DeepSpeed's shards) is refused in one sentence."""
    from .outputs import is_example_name

    if not is_example_name(Path(path).name):
        return None
    kind, _, number = Path(path).name.partition("_")
    files = {p.name for p in Path(path).iterdir()} if Path(path).is_dir() else set()
    if not (files & {"model.safetensors", "pytorch_model.bin"} and "optimizer.bin" in files):
        from .errors import CheckpointError

        raise CheckpointError(
            f"{path} is named as a transformers example's checkpoint but holds no model.safetensors (or "
            "pytorch_model.bin) with optimizer.bin: the recipes resume the examples' one-process and DDP "
            "saves, not FSDP's or DeepSpeed's sharded ones; start a fresh run, or resume it with the example."
        )
    return kind, int(number)
