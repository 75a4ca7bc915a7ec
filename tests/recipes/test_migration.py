"""A transformers no_trainer user's command works unchanged on the recipe that stands in for it
(issue #64; docs/migrating.md).

- Every flag of the four examples' parsers (tests/data/no_trainer/flags.json, read from their
  source) is a flag of the recipe's own parser (the same flag, or another option string of one),
  taken with the example's meaning or refused in one sentence; a flag a newer release adds is
  named; docs/migrating.md's table is the one generated from the parsers.
- The examples' own test command lines run on the recipes, on data of our own in the examples'
  formats (tests/data/no_trainer), and leave all_results.json with the example's keys beside
  eval_results.json, from the same numbers. Only the model and the files are ours: a tiny BERT for
  the Hub model, the fixtures for transformers' test files.
- Their README command lines, which read the Hub, parse, and offline stop with one sentence.
- A folder the example's --checkpointing_steps writes (accelerator.save_state into epoch_<i> or
  step_<n>) resumes on the recipe.
- --hf_example_defaults takes the examples' defaults; --report_to names a tracker not installed.
"""

import json
import logging
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import RECIPES, REPO, TINY_BERT, accelerate_launch, load_recipe, reset_accelerate, run, train
from safetensors.torch import load_file

from amp_recipes.errors import InputError
from amp_recipes.training.checkpoint import LATEST, MARKER

FIXTURES = REPO / "tests" / "data" / "no_trainer"
SNAPSHOT = json.loads((FIXTURES / "flags.json").read_text())["examples"]
sys.path.insert(0, str(REPO / "scripts"))
import no_trainer_flags  # noqa: E402


# ----------------------------------------------------------------------------- every flag
def base_argv(recipe: str, flag: str) -> list[str]:
    """The least a recipe needs to parse, with nothing that conflicts with `flag`."""
    if recipe == "bert_glue":
        return [] if flag in ("--task_name", *PAIRED) else ["--task_name", "mrpc"]
    if recipe == "bert_mlm":
        return [] if flag == "--dataset_name" else ["--train_file", "text.txt"]
    return []


VALUES = {  # a value as a user of the example writes it (None: a switch)
    "--lr_scheduler_type": "constant",
    "--report_to": "all",
    "--checkpointing_steps": "epoch",
    "--resume_from_checkpoint": "",
    "--model_type": "bert",
    "--text_column_name": "words",
    "--label_column_name": "ner",
    "--max_length": "64",
    "--validation_split_percentage": "5",
    "--null_score_diff_threshold": "0.0",
    "--mlm_probability": "0.2",
    "--learning_rate": "3e-5",
    "--weight_decay": "0.0",
}


PAIRED = {  # what the flag needs beside it in the examples too (they evaluate, so they read both files)
    "--train_file": ["--validation_file", "dev.json"],
    "--validation_file": ["--train_file", "train.json"],
    "--test_file": ["--do_predict"],
    "--do_predict": ["--test_file", "q.json"],
}


def example_tokens(recipe: str, flag: str, spec: dict) -> list[str]:
    """The flag as the example's parser takes it (a switch alone, a `type=bool` flag with a value),
    then what it needs beside it."""
    if spec.get("action") == '"store_true"':
        return [flag, *PAIRED.get(flag, [])]
    if spec.get("type") == "bool":
        return [flag, "True"]
    if flag == "--task_name":
        return [flag, "mrpc" if recipe == "bert_glue" else "chunk"]
    if flag in VALUES:
        return [flag, VALUES[flag]]
    if spec.get("type") in ("int", "float"):
        return [flag, "8"]
    return [flag, "value.json", *PAIRED.get(flag, [])]


def every_example_flag():
    for recipe, flags in SNAPSHOT.items():
        for flag, spec in flags.items():
            yield pytest.param(recipe, flag, spec, id=f"{recipe}{flag}")


@pytest.mark.parametrize("recipe, flag, spec", every_example_flag())
def test_every_flag_of_the_example_is_taken_or_refused_in_one_sentence(recipe, flag, spec, capsys):
    module = load_recipe(recipe)
    action = module.build_parser()._option_string_actions.get(flag)
    assert action is not None, f"{flag} of {recipe}'s example is not a flag of the recipe"
    tokens = example_tokens(recipe, flag, spec)
    if action.help.startswith("Refused"):
        with pytest.raises(SystemExit):
            module.parse_args([*base_argv(recipe, flag), *tokens])
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.split(": error: ", 1)[1].startswith(
            f"{flag} {tokens[1]} builds a model from random weights"
        )
        return
    args = module.parse_args([*base_argv(recipe, flag), *tokens])
    dest = action.dest
    if action.option_strings[0] != flag:  # another name of the recipe's flag
        assert str(getattr(args, dest)) == tokens[1]  # the recipe's own flag holds the example's value
    elif flag == "--resume_from_checkpoint":
        assert args.resume_from_checkpoint is None  # the example's empty value: no resume
    elif len(tokens) == 1 or spec.get("type") == "bool":
        assert getattr(args, dest) is True
    reset_accelerate()


def test_a_flag_a_newer_release_adds_is_named():
    """scripts/no_trainer_flags.py's check, on the snapshot as a newer release might read."""
    assert no_trainer_flags.gaps(SNAPSHOT) == []
    newer = {recipe: dict(flags) for recipe, flags in SNAPSHOT.items()}
    newer["bert_glue"]["--low_cpu_mem_usage"] = {"action": '"store_true"'}
    assert no_trainer_flags.gaps(newer) == [
        "bert_glue: --low_cpu_mem_usage of its example is not a flag of the recipe"
    ]


def test_the_migration_page_shows_the_table_the_parsers_make():
    """The table is generated from the recipes' parsers (`python scripts/no_trainer_flags.py --docs`)."""
    table = no_trainer_flags.table(SNAPSHOT)
    assert "| `--max_length` | glue, ner | alias of `--max_seq_length` | 128 (128) |" in table
    assert "| `--model_type` | ner, qa, mlm | refused |" in table
    assert table in (REPO / "docs" / "migrating.md").read_text(), (
        "run python scripts/no_trainer_flags.py --docs"
    )


def test_the_example_defaults_on_request(capsys):
    """--hf_example_defaults: the examples' numbers for every flag not given; what is given stays."""
    glue = load_recipe("bert_glue")
    args = glue.parse_args(["--task_name", "mrpc", "--hf_example_defaults", "--learning_rate", "3e-5"])
    assert (args.per_device_train_batch_size, args.per_device_eval_batch_size, args.learning_rate) == (
        8,
        8,
        3e-5,
    )
    assert (args.weight_decay, args.num_warmup_steps, args.max_grad_norm) == (0.0, 0, 0.0)
    assert args.seed is None  # unseeded there: drawn at the run's start, once for the launch (below)
    assert args.group_by_length is False  # the examples' plain shuffle
    ours = glue.parse_args(["--task_name", "mrpc"])
    assert (ours.per_device_train_batch_size, ours.learning_rate, ours.seed, ours.max_grad_norm) == (
        32,
        2e-5,
        42,
        1.0,
    )
    assert ours.group_by_length is True
    assert glue.parse_args(
        ["--task_name", "mrpc", "--hf_example_defaults", "--group_by_length"]
    ).group_by_length
    assert glue.parse_args(["--task_name", "mrpc", "--no_group_by_length"]).group_by_length is False
    mlm = load_recipe("bert_mlm").parse_args(["--train_file", "t.txt", "--hf_example_defaults"])
    assert (mlm.max_seq_length, mlm.num_train_epochs) == (None, 3)  # the model's own length, at most 1024
    with pytest.raises(SystemExit):
        glue.parse_args(["--task_name", "mrpc", "--report_to", "comet_ml"])
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --report_to comet_ml needs the comet_ml package: pip install comet_ml.")
    )
    tracked = glue.parse_args(["--task_name", "mrpc", "--with_tracking"])
    assert (tracked.report_to, tracked.project_name) == ("all", "glue_no_trainer")


def test_an_alias_out_of_range_is_named_as_written(capsys):
    with pytest.raises(SystemExit):
        load_recipe("bert_ner").parse_args(["--max_length=-1"])
    assert capsys.readouterr().err.strip().endswith("error: --max_length must be at least 1, not -1.")


def test_an_alias_and_its_flag_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        load_recipe("bert_glue").parse_args(
            ["--task_name", "mrpc", "--max_length=256", "--max_seq_length", "128"]
        )
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --max_length and --max_seq_length are the same setting: give one of them.")
    )


SETTLE_SEED = """
import argparse, logging, sys
from pathlib import Path
from accelerate import Accelerator
from amp_recipes import no_trainer
logging.basicConfig(level=logging.INFO)
accelerator = Accelerator()
resume = None if sys.argv[1] == "none" else sys.argv[1]
args = argparse.Namespace(seed=None, resume_from_checkpoint=resume)
no_trainer.settle_seed(accelerator, args, Path(resume or "."))
sys.stdout.write(f"rank {accelerator.process_index} seed {args.seed}\\n")  # one write: lines never interleave
sys.stdout.flush()
accelerator.end_training()  # the process group ended before exit: else gloo can abort the exit
"""


def test_an_unseeded_run_draws_one_seed_for_the_launch_and_resumes_with_it(tmp_path):
    """--hf_example_defaults leaves --seed unset, as the examples do: every process of a launch must
    shuffle and shard alike, so the main process draws it and sends it; a resume takes the
    checkpoint's, which it must match."""
    script = tmp_path / "settle_seed.py"
    script.write_text(SETTLE_SEED)
    two = ["--multi_gpu", "--num_processes", 2, "--num_cpu_threads_per_process", 1]
    launched = run(accelerate_launch(*two, script, "none"), tmp_path, ACCELERATE_USE_CPU="1")
    assert launched.returncode == 0, launched.stderr[-3000:]
    seeds = sorted(line.split()[-1] for line in launched.stdout.splitlines() if line.startswith("rank "))
    assert len(seeds) == 2 and seeds[0] == seeds[1] and seeds[0] != "None", launched.stdout
    assert f"--seed not given: {seeds[0]}, drawn for this run" in launched.stderr
    saved = tmp_path / "checkpoints" / "checkpoint-4"
    saved.mkdir(parents=True)
    (saved / MARKER).write_text(json.dumps({"global_step": 4, "seed": 1234}))
    (tmp_path / "checkpoints" / LATEST).write_text("checkpoint-4")
    resumed = run([sys.executable, script, tmp_path / "checkpoints"], tmp_path)
    assert resumed.returncode == 0 and "rank 0 seed 1234" in resumed.stdout, resumed.stderr[-3000:]


# ----------------------------------------------------------------------------- the examples' own commands
@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The tiny BERT without its classifier, as a Hub base model is (bert-base-cased and the like):
    each recipe starts its own head."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("base-model")
    BertForSequenceClassification.from_pretrained(TINY_BERT).bert.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_BERT).save_pretrained(folder)
    return folder


def example_test_command(recipe: str, model: Path, output_dir: Path) -> list:
    """transformers' examples/pytorch/test_accelerate_examples.py command line for the example,
    with our model and our files in the example's formats in place of its Hub model and fixtures."""
    commands = {
        "bert_glue": f"--model_name_or_path {model} --output_dir {output_dir} "
        f"--train_file {FIXTURES}/mrpc_train.csv --validation_file {FIXTURES}/mrpc_dev.csv "
        "--per_device_train_batch_size=2 --per_device_eval_batch_size=1 --learning_rate=1e-4 --seed=42 "
        "--num_warmup_steps=2 --checkpointing_steps epoch --with_tracking",
        "bert_ner": f"--model_name_or_path {model} --train_file {FIXTURES}/conll.json "
        f"--validation_file {FIXTURES}/conll.json --output_dir {output_dir} --learning_rate=2e-4 "
        "--per_device_train_batch_size=2 --per_device_eval_batch_size=2 --num_train_epochs=2 --seed 7 "
        "--checkpointing_steps epoch --with_tracking",
        "bert_qa": f"--model_name_or_path {model} --version_2_with_negative "
        f"--train_file {FIXTURES}/squad_v2.json --validation_file {FIXTURES}/squad_v2.json "
        f"--output_dir {output_dir} --seed=42 --max_train_steps=10 --num_warmup_steps=2 --learning_rate=2e-4 "
        "--per_device_train_batch_size=2 --per_device_eval_batch_size=1 --checkpointing_steps epoch "
        "--with_tracking",
        "bert_mlm": f"--model_name_or_path {model} --train_file {FIXTURES}/sample_text.txt "
        f"--validation_file {FIXTURES}/sample_text.txt --output_dir {output_dir} --num_train_epochs=1 "
        "--checkpointing_steps epoch --with_tracking",
    }
    return [RECIPES / f"{recipe}.py", *shlex.split(commands[recipe])]


ALL_RESULTS_KEYS = {  # the example's all_results.json keys (ours may add, never lack one)
    "bert_glue": {"eval_accuracy"},
    "bert_ner": {"eval_precision", "eval_recall", "eval_f1", "eval_accuracy", "train_loss"},
    "bert_qa": {"eval_exact", "eval_f1", "eval_total", "eval_HasAns_exact", "eval_NoAns_exact"},
    "bert_mlm": {"perplexity"},
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(no_trainer_flags.EXAMPLES))
def test_the_examples_test_command_runs_unchanged_and_leaves_all_results_json(recipe, base_model, tmp_path):
    """Each example's command line from transformers' test_accelerate_examples.py; GLUE's through
    `accelerate launch` as that test runs it, the others in this process (the launcher is the same
    for every recipe; what differs is the command line)."""
    output_dir = tmp_path / "out"
    script, *argv = example_test_command(recipe, base_model, output_dir)
    if recipe == "bert_glue":
        result = run(accelerate_launch("--num_processes", 1, script, *argv), tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        train(load_recipe(recipe), argv)
    all_results = json.loads((output_dir / "all_results.json").read_text())
    results = json.loads((output_dir / "eval_results.json").read_text())
    assert ALL_RESULTS_KEYS[recipe] <= set(all_results), all_results
    if recipe == "bert_mlm":
        assert all_results == {"perplexity": results["eval_perplexity"]}
    elif recipe == "bert_ner":  # the example's four overall scores, not each entity type's
        assert (
            set(all_results) == ALL_RESULTS_KEYS[recipe]
            and all_results["train_loss"] == results["train_loss"]
        )
    assert all(all_results[k] == results[k] for k in all_results if k in results)  # the same numbers
    checkpoints = sorted(p.name for p in (output_dir / "checkpoints").glob("checkpoint-*"))
    assert checkpoints and results["train_steps"] == int(checkpoints[-1].split("-")[1])  # one per epoch
    assert (output_dir / "epoch_0" / MARKER).is_file()  # what the example's test asserts: epoch_0 exists
    # --with_tracking: every installed tracker, in the example's project (TensorBoard's folder).
    project = f"{recipe.removeprefix('bert_')}_no_trainer"
    assert (output_dir / project).is_dir() and any((output_dir / project).rglob("events.out.tfevents*"))


README_COMMANDS = {  # the no_trainer command line of each example's README, our tiny model for the Hub's
    "bert_glue": "--model_name_or_path {model} --task_name mrpc --max_length 128 "
    "--per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 --output_dir {out}",
    "bert_ner": "--model_name_or_path {model} --dataset_name conll2003 --task_name ner --max_length 128 "
    "--per_device_train_batch_size 32 --learning_rate 2e-5 --num_train_epochs 3 --output_dir {out}",
    "bert_qa": "--model_name_or_path {model} --dataset_name squad --max_seq_length 384 --doc_stride 128 "
    "--output_dir {out}",
    "bert_mlm": "--dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --model_name_or_path {model} "
    "--output_dir {out}",
}


@pytest.mark.parametrize("recipe", list(no_trainer_flags.EXAMPLES))
def test_the_readme_command_parses_and_offline_stops_with_one_sentence(recipe, base_model, tmp_path):
    """The README's command reads the Hub's dataset: every flag parses with the example's meaning,
    and here, offline, the run stops before any training with the one sentence that says why."""
    argv = shlex.split(README_COMMANDS[recipe].format(model=base_model, out=tmp_path / "out"))
    module = load_recipe(recipe)
    args = module.parse_args(argv)
    if recipe in ("bert_glue", "bert_ner"):
        assert args.max_seq_length == 128  # --max_length
    # An InputError, which the recipe prints as `error: <sentence>` (test_bad_input.py's matrix).
    with pytest.raises(InputError) as stopped:
        train(module, argv)
    sentence = str(stopped.value)
    assert sentence.startswith("Could not load ") and "from the Hugging Face Hub" in sentence
    assert "Offline?" in sentence and "\n" not in sentence


# ----------------------------------------------------------------------------- the example's checkpoints
def example_save_state(folder: Path, model_dir: Path, steps: int) -> None:
    """What run_glue_no_trainer.py does up to its --checkpointing_steps save, in this process:
    its objects (example_objects), `steps` optimizer steps, then accelerator.save_state(folder)."""
    accelerator, model, optimizer, loader, scheduler = example_objects(model_dir)
    for _, batch in zip(range(steps), loader, strict=False):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(str(folder))
    reset_accelerate()


def example_objects(model_dir: Path):
    """run_glue_no_trainer.py's objects, prepared as it prepares them: its Accelerator, model,
    AdamW with its parameter groups, linear schedule, and batches of 2 of the MRPC csv."""
    from accelerate import Accelerator
    from datasets import load_dataset
    from torch.utils.data import DataLoader
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        get_scheduler,
    )
    from transformers.trainer_pt_utils import get_parameter_names

    reset_accelerate()
    accelerator = Accelerator()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    raw = load_dataset("csv", data_files={"train": str(FIXTURES / "mrpc_train.csv")})["train"]
    labels = {"equivalent": 1, "not_equivalent": 0}
    data = raw.map(
        lambda b: {**tokenizer(b["sentence1"], b["sentence2"], truncation=True, max_length=128),
                   "labels": [labels[x] for x in b["label"]]},
        batched=True,
        remove_columns=raw.column_names,
    )  # fmt: skip
    loader = DataLoader(data, shuffle=True, batch_size=2, collate_fn=DataCollatorWithPadding(tokenizer))
    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = get_parameter_names(model, [torch.nn.LayerNorm], forbidden_layer_names=forbidden)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=5e-5)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=3 * len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return accelerator, model, optimizer, loader, scheduler


def test_the_example_loads_the_recipes_epoch_folder(base_model, tmp_path):
    """The example's own `--resume_from_checkpoint <output_dir>/epoch_0` reads the folder the
    recipe writes under that name: its accelerator.load_state, on the example's model, AdamW
    groups and schedule, loads the recipe's weights, the optimizer's moments after the epoch's 24
    steps and the schedule's position. (The recipe resuming its own folders:
    test_round_trip.test_the_examples_checkpoint_folders_resume_exactly.)"""
    output_dir = tmp_path / "out"
    argv = [
        *("--train_file", FIXTURES / "mrpc_train.csv", "--validation_file", FIXTURES / "mrpc_dev.csv"),
        *("--model_name_or_path", base_model, "--per_device_train_batch_size", 2, "--output_dir", output_dir),
        *("--num_train_epochs", 1, "--checkpointing_steps", "epoch", "--weight_decay", 0.0),
    ]
    train(load_recipe("bert_glue"), argv)
    accelerator, model, optimizer, _, scheduler = example_objects(base_model)
    accelerator.load_state(str(output_dir / "epoch_0"))
    saved = load_file(str(output_dir / "epoch_0" / "model.safetensors"))
    state = accelerator.unwrap_model(model).state_dict()
    assert saved and all(torch.equal(state[key], tensor) for key, tensor in saved.items())
    assert {int(s["step"]) for s in optimizer.state_dict()["state"].values()} == {24}
    assert scheduler.scheduler.last_epoch == 24
    reset_accelerate()


def test_a_sharded_folder_the_example_saved_is_refused_in_one_sentence(base_model, tmp_path):
    """An example run under FSDP saves its model and optimizer as shards: not loadable here."""
    saved = tmp_path / "step_5"
    (saved / "pytorch_model_fsdp_0").mkdir(parents=True)
    (saved / "optimizer_0").mkdir()
    argv = [
        *("--train_file", FIXTURES / "mrpc_train.csv", "--validation_file", FIXTURES / "mrpc_dev.csv"),
        *("--model_name_or_path", base_model, "--output_dir", tmp_path / "out"),
        *("--resume_from_checkpoint", saved),
    ]
    # An InputError, which the recipe prints as `error: <sentence>` (test_bad_input.py's matrix).
    with pytest.raises(InputError) as refused:
        train(load_recipe("bert_glue"), argv)
    sentence = str(refused.value)
    assert sentence.startswith(f"{saved} is named as a transformers example's checkpoint") and (
        "not FSDP's or DeepSpeed's sharded ones" in sentence
    ), sentence
    assert "\n" not in sentence


@pytest.mark.parametrize("kind", ["epoch_0", "step_5"])
def test_a_folder_the_example_saved_resumes(kind, base_model, tmp_path, caplog):
    """epoch_0 (after the example's first epoch: 24 steps of 48 pairs in batches of 2) resumes at
    the start of epoch 2; step_5 at optimizer step 5, 5 batches into epoch 1. The recipe loads the
    folder's weights (resumed at its own last step it trains no further: its model is the folder's),
    its optimizer and schedule, and says where it placed the run and that the batch order is its own."""
    saved = tmp_path / "example" / kind
    steps = 24 if kind == "epoch_0" else 5
    example_save_state(saved, base_model, steps)
    output_dir = tmp_path / "out"
    argv = [
        *("--train_file", FIXTURES / "mrpc_train.csv", "--validation_file", FIXTURES / "mrpc_dev.csv"),
        *("--model_name_or_path", base_model, "--per_device_train_batch_size", 2, "--output_dir", output_dir),
        *("--resume_from_checkpoint", saved, "--max_train_steps", steps + (0 if kind == "epoch_0" else 3)),
        *("--logging_steps", 1, "--learning_rate", 5e-5, "--weight_decay", 0.0),
    ]
    with caplog.at_level(logging.WARNING):
        train(load_recipe("bert_glue"), argv)
    position = (
        "step 24, epoch 2, 0 batches into it" if kind == "epoch_0" else "step 5, epoch 1, 5 batches into it"
    )
    assert "which a transformers no_trainer example wrote" in caplog.text and position in caplog.text
    history = [json.loads(line) for line in (output_dir / "log_history.jsonl").read_text().splitlines()]
    trained = [row["step"] for row in history if "loss" in row]
    results = json.loads((output_dir / "eval_results.json").read_text())
    if kind == "epoch_0":  # nothing left to train: the saved model is the folder's weights
        assert trained == [] and results["train_steps"] == 24
        ours, theirs = (
            load_file(str(output_dir / "model.safetensors")),
            load_file(str(saved / "model.safetensors")),
        )
        assert set(ours) <= set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    else:
        assert trained == [6, 7, 8] and results["train_steps"] == 8
