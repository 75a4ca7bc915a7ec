"""The recipes as drop-ins for transformers' accelerate examples: a `run_*_no_trainer.py` command
line runs unchanged on the recipe that stands in for it, trains the same job, and leaves the
example's files (`all_results.json`) beside the recipe's own.

    accelerate launch recipes/bert_glue.py --model_name_or_path bert-base-cased --task_name mrpc \\
        --max_length 128 --per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 \\
        --output_dir /tmp/mrpc/                     # text-classification/run_glue_no_trainer.py's README

The examples' flags are the recipes' own (amp_recipes.arguments and each recipe's parser; an
example's other name for a flag is another option string of it): docs/migrating.md's table is
generated from those parsers by scripts/no_trainer_flags.py, which also names every flag of a
newer release's examples that a recipe does not take. Here: the example's seed policy, tokenizer
and length settings, and its all_results.json (amp_recipes.training.checkpoint resumes its checkpoint
folders).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

MLM_LONGEST = 1024  # the MLM example's cap on the model's own maximum length


def settle_seed(accelerator, args, checkpoints_dir: Path) -> None:
    """--seed unset (the examples' unseeded run, --hf_example_defaults): a seed for the whole
    launch, recorded like any other. Resumed, the checkpoint's (it must match); else drawn on the
    main process and sent to the others, whose shuffles and shards must agree."""
    if args.seed is not None:
        return
    from accelerate.logging import get_logger
    from accelerate.utils import broadcast_object_list

    from amp_recipes.training import checkpoint

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
    recipe = args.example
    scores = {
        name: value
        for name, value in summary.items()
        if name.startswith("eval_")
        and isinstance(value, (int, float))
        and not name.startswith(("eval_samples", "eval_windows", "eval_truncated"))
    }
    if recipe == "mlm":
        return {"perplexity": summary.get("eval_perplexity")}
    if recipe == "ner":
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
    from amp_recipes.training.outputs import write_text_atomic

    write_text_atomic(os.path.join(output_dir, "all_results.json"), json.dumps(results))
