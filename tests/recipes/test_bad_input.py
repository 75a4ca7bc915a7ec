"""Every recipe against a matrix of bad inputs: files, flags, output folders, models, checkpoints.

Each case starts from a run that works (the `works` case runs it), breaks one thing, and runs the
recipe's command line in this process (`runpy`, as `python recipes/<name>.py` would; in process
because the whole matrix in subprocesses would cost minutes of imports). What every case must show:

- a non-zero exit, and a last line beginning `error:` (argparse: `<script>: error:`) that names
  the file or flag and what to do;
- no traceback anywhere in the output (datasets' own error log lines included);
- no file that existed before the run changed: the case's data, the model, and an output folder
  that holds a finished run (passed with --overwrite_output_dir, so a late failure would show);
- no lock file left behind.

bert_ner's and bert_qa's own numeric flags get the out-of-range rows; their shared ones go
through the same `check_shared_args` as the other recipes' (bert_glue's rows test it).
"""

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import RECIPES, TINY_BERT, reset_accelerate

from amp_recipes.training.outputs import LOCK, release_held

ERROR_LINE = r"^(bert_\w+\.py: )?error: "


# ----------------------------------------------------------------------------- running a command line
def stream_handlers():
    """Every logging handler that writes to a stream it holds (each once)."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    handlers = {
        id(handler): handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler)
        and not isinstance(
            handler, (logging.FileHandler, logging._StderrHandler)
        )  # that one reads sys.stderr
    }
    return list(handlers.values())


def run_command_line(recipe_file: Path, argv: list) -> tuple[int, str]:
    """(exit status, everything printed) of `python <recipe_file> <argv>`, run in this process:
    what the interpreter does at exit is done here (sys.exit("...") prints the text, status 1; an
    uncaught exception prints its traceback; the process's locks are released)."""
    output = io.StringIO()
    handlers = stream_handlers()
    streams = [handler.setStream(output) for handler in handlers]  # every logger, datasets' too
    saved_argv, sys.argv = sys.argv, [str(recipe_file), *map(str, argv)]
    reset_accelerate()
    status = 0
    try:
        with contextlib.redirect_stderr(output), contextlib.redirect_stdout(output):
            runpy.run_path(str(recipe_file), run_name="__main__")
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
        if isinstance(exit_.code, str):
            output.write(exit_.code + "\n")
    except BaseException:
        output.write(traceback.format_exc())
        status = 1
    finally:
        sys.argv = saved_argv
        for handler, stream in zip(handlers, streams, strict=True):
            handler.setStream(stream)
        release_held()
        reset_accelerate()
    return status, output.getvalue()


def checksums(*roots: Path) -> dict[str, str]:
    found = {}
    for root in roots:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


# ----------------------------------------------------------------------------- the working runs
def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def finished_run(output_dir: Path) -> None:
    """What a finished run leaves (abridged): the model, eval_results.json, one checkpoint."""
    write(output_dir / "model.safetensors", "old weights")
    write(output_dir / "config.json", "{}")
    write(output_dir / "eval_results.json", json.dumps({"eval_accuracy": 0.5}))
    write(output_dir / "log_history.jsonl", '{"step": 1, "loss": 0.7}\n')
    checkpoint = output_dir / "checkpoints" / "checkpoint-1"
    write(checkpoint / "model.safetensors", "old")
    write(checkpoint / "amp_checkpoint.json", json.dumps({"files": {"model.safetensors": 11}}))
    write(output_dir / "checkpoints" / "latest", "checkpoint-1")
    write(output_dir / "epoch_0" / "model.safetensors", "old")  # the examples' name for it (hard links)
    write(output_dir / "epoch_0" / "amp_checkpoint.json", json.dumps({"files": {"model.safetensors": 11}}))


def glue_run(case: Path) -> dict:
    rows = [("good film", "pos"), ("dull plot", "neg"), ("great cast", "pos"), ("weak end", "neg")]
    write(case / "train.csv", "text,label\n" + "".join(f"{t},{label}\n" for t, label in rows * 2))
    write(case / "dev.csv", "text,label\n" + "".join(f"{t},{label}\n" for t, label in rows))
    finished_run(case / "out")
    return {
        "train_file": case / "train.csv",
        "validation_file": case / "dev.csv",
        "model_name_or_path": TINY_BERT,
        "output_dir": case / "out",
        "overwrite_output_dir": True,
        "max_train_steps": 1,
        "per_device_train_batch_size": 4,
        "max_seq_length": 32,
        "activation_monitor_interval": 0,
    }


def mlm_run(case: Path) -> dict:
    write(
        case / "corpus.txt", "".join(f"the quick brown fox jumps over the lazy dog {i}\n" for i in range(40))
    )
    finished_run(case / "out")
    return {
        "train_file": case / "corpus.txt",
        "model_name_or_path": TINY_BERT,
        "output_dir": case / "out",
        "overwrite_output_dir": True,
        "max_train_steps": 1,
        "per_device_train_batch_size": 4,
        "max_seq_length": 16,
        "activation_monitor_interval": 0,
    }


CONLL_TRAIN = "EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\nPeter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n\n"
CONLL_VALID = "-DOCSTART- -X- -X- O\n\nPeter NNP B-NP B-PER\nsaid VBD B-VP O\n\n"


def ner_run(case: Path) -> dict:
    write(case / "train.txt", "-DOCSTART- -X- -X- O\n\n" + CONLL_TRAIN * 4)
    write(case / "valid.txt", CONLL_VALID)
    finished_run(case / "out")
    return {
        "train_file": case / "train.txt",
        "validation_file": case / "valid.txt",
        "model_name_or_path": TINY_BERT,
        "ignore_mismatched_sizes": True,  # the tiny BERT's head classifies sentences (2 labels)
        "output_dir": case / "out",
        "overwrite_output_dir": True,
        "max_train_steps": 1,
        "per_device_train_batch_size": 4,
        "max_seq_length": 16,
        "activation_monitor_interval": 0,
    }


def squad_json(*questions, context="Ada Lovelace wrote the first program in 1843."):
    qas = [
        {
            "id": str(i),
            "question": question,
            "answers": [{"text": answer, "answer_start": context.index(answer)}],
        }
        for i, (question, answer) in enumerate(questions)
    ]
    return json.dumps({"data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]})


def qa_run(case: Path) -> dict:
    write(case / "train.json", squad_json(("Who wrote it?", "Ada Lovelace"), ("When?", "1843")))
    write(case / "dev.json", squad_json(("Who wrote the first program?", "Ada Lovelace")))
    finished_run(case / "out")
    return {
        "train_file": case / "train.json",
        "validation_file": case / "dev.json",
        "model_name_or_path": TINY_BERT,
        "output_dir": case / "out",
        "overwrite_output_dir": True,
        "max_train_steps": 1,
        "per_device_train_batch_size": 4,
        "max_seq_length": 48,
        "doc_stride": 8,
        "max_query_length": 16,
        "activation_monitor_interval": 0,
    }


WORKING_RUNS = {"bert_glue": glue_run, "bert_mlm": mlm_run, "bert_ner": ner_run, "bert_qa": qa_run}


def argv_of(flags: dict) -> list:
    argv = []
    for name, value in flags.items():
        if value is not None and value is not False:
            argv += [f"--{name}"] + ([] if value is True else [value])
    return argv


# ----------------------------------------------------------------------------- the matrix
@dataclass
class Case:
    name: str
    recipes: tuple[str, ...]
    breaks: object  # (case_dir, flags) -> None: edits the flags, writes files
    message: str  # regex the error line must match


BOTH = ("bert_glue", "bert_mlm")
ALL = ("bert_glue", "bert_mlm", "bert_ner", "bert_qa")


def bad_file(flag, filename, content):
    def breaks(case, flags):
        flags[flag] = write(case / filename, content)

    return breaks


def setting(**changes):
    def breaks(case, flags):
        flags.update(changes)

    return breaks


def file_cases():
    """Bad data files, in every format each recipe reads; the message names the file."""
    glue = {  # (file, content, message) replacing bert_glue's --train_file
        "csv-empty": ("bad.csv", "", r"bad\.csv is empty"),
        "csv-header-only": ("bad.csv", "text,label\n", r"bad\.csv holds no rows"),
        "csv-long-row": (
            "bad.csv",
            "text,label\na,pos,x\nb,neg\n",
            r"bad\.csv line 2 has 3 fields, its header 2",
        ),
        "csv-not-utf8": ("bad.csv", b"text,label\ncaf\xe9,pos\nok,neg\n", r"bad\.csv line 2 is not UTF-8"),
        "csv-empty-label": ("bad.csv", "text,label\nok,pos\nbad,\n", r"bad\.csv row 2 has no label"),
        "csv-empty-text": (
            "bad.csv",
            "text,label\n,pos\nok,neg\n",
            r"bad\.csv row 1: the 'text' text is empty",
        ),
        "csv-tab-separated": (
            "bad.csv",
            "text\tlabel\na\tpos\nb\tneg\n",
            r"bad\.csv has a single column .*comma-sep",
        ),
        "csv-mixed-labels": (
            "bad.csv",
            "text,label\na,1\nb,pos\n",
            r"bad\.csv mixes class names \(row 2: 'pos'\)",
        ),
        "csv-decimal-classes": (
            "bad.csv",
            "text,label\na,1.0\nb,0.0\n",
            r"bad\.csv: .*decimals.*--label_type",
        ),
        "csv-one-class": (
            "bad.csv",
            "text,label\na,pos\nb,pos\n",
            r"bad\.csv: classification needs at least two",
        ),
        "csv-no-label-column": (
            "bad.csv",
            "text,stars\na,1\nb,0\n",
            r"bad\.csv has no column\(s\) \['label'\]",
        ),
        "csv-no-text-column": ("bad.csv", "label\npos\nneg\n", r"bad\.csv: no text columns found"),
        "tsv-empty": ("bad.tsv", "", r"bad\.tsv is empty"),
        "tsv-header-only": ("bad.tsv", "text\tlabel\n", r"bad\.tsv holds no rows"),
        "tsv-long-row": ("bad.tsv", "text\tlabel\na\tpos\tx\n", r"bad\.tsv line 2 has 3 fields"),
        "tsv-not-utf8": ("bad.tsv", b"text\tlabel\nok\tpos\n\xff\tneg\n", r"bad\.tsv line 3 is not UTF-8"),
        "tsv-empty-label": ("bad.tsv", "text\tlabel\nok\tpos\nbad\t\n", r"bad\.tsv row 2 has no label"),
        "tsv-comma-separated": (
            "bad.tsv",
            "text,label\na,pos\nb,neg\n",
            r"bad\.tsv has a single column .*tab-sep",
        ),
        "json-empty": ("bad.json", "", r"bad\.json is empty"),
        "json-truncated": ("bad.json", '[{"text": "a", "label": "pos"', r"bad\.json is not valid JSON"),
        "json-no-rows": ("bad.json", "[]", r"bad\.json holds no rows"),
        "json-null-label": (
            "bad.json",
            '[{"text": "a", "label": "pos"}, {"text": "b", "label": null}]',
            r"bad\.json row 2 has no label",
        ),
        "json-null-text": (
            "bad.json",
            '[{"text": null, "label": "pos"}, {"text": "b", "label": "neg"}]',
            r"bad\.json row 1: the 'text' text is empty",
        ),
        "jsonl-empty": ("bad.jsonl", "", r"bad\.jsonl is empty"),
        "jsonl-blank-lines": ("bad.jsonl", "\n\n", r"bad\.jsonl holds no rows"),
        "jsonl-bad-line": (
            "bad.jsonl",
            '{"text": "a", "label": "pos"}\n{"text": "b", label: "neg"}\n',
            r"bad\.jsonl line 2 is not valid JSON",
        ),
        "jsonl-not-an-object": (
            "bad.jsonl",
            '{"text": "a", "label": "pos"}\n[1, 2]\n',
            r"bad\.jsonl line 2 is not a JSON object",
        ),
        "jsonl-not-utf8": (
            "bad.jsonl",
            b'{"text": "caf\xe9", "label": "pos"}\n',
            r"bad\.jsonl line 1 is not UTF-8",
        ),
        "jsonl-mixed-labels": (
            "bad.jsonl",
            '{"text": "a", "label": 1}\n{"text": "b", "label": "pos"}\n',
            r"bad\.jsonl mixes class names",
        ),
        "jsonl-empty-label": (
            "bad.jsonl",
            '{"text": "a", "label": "pos"}\n{"text": "b", "label": ""}\n',
            r"bad\.jsonl row 2 has no label",
        ),
        "parquet": ("bad.parquet", "PAR1", r"bad\.parquet: unsupported file type '\.parquet'"),
    }
    mlm = {  # replacing bert_mlm's --train_file
        "txt-empty": ("bad.txt", "", r"bad\.txt is empty"),
        "txt-blank-lines": ("bad.txt", "\n  \n\n", r"bad\.txt holds no text"),
        "txt-not-utf8": ("bad.txt", b"fine\nna\xefve\n", r"bad\.txt line 2 is not UTF-8"),
        "csv-no-text-column": ("bad.csv", "body\nhello\n", r"bad\.csv has no column 'text'.*--text_column"),
        "csv-header-only": ("bad.csv", "text\n", r"bad\.csv holds no rows"),
        "json-truncated": ("bad.json", '[{"text": "a"', r"bad\.json is not valid JSON"),
        "jsonl-bad-line": (
            "bad.jsonl",
            '{"text": "a"}\n{"text": }\n',
            r"bad\.jsonl line 2 is not valid JSON",
        ),
        "parquet": ("bad.parquet", "PAR1", r"bad\.parquet: unsupported file type"),
    }
    ner = {  # replacing bert_ner's --train_file
        "conll-columns": (
            "bad.txt",
            "EU NNP B-NP B-ORG\nrejects VBZ O\n",
            r"bad\.txt line 2 has 3 columns, line 1 has 4",
        ),
        "conll-one-column": ("bad.conll", "EU\nrejects\n", r"bad\.conll line 1 has one column"),
        "conll-empty": ("bad.txt", "", r"bad\.txt is empty"),
        "conll-only-docstart": ("bad.txt", "-DOCSTART- -X- -X- O\n\n", r"bad\.txt holds no sentences"),
        "conll-not-utf8": ("bad.txt", b"EU B-ORG\ncaf\xe9 O\n", r"bad\.txt line 2 is not UTF-8"),
        "conll-untyped-tag": ("bad.txt", "EU ORG\n", r"bad\.txt line 1: tag 'ORG' is neither O nor"),
        "conll-no-entities": ("bad.txt", "EU O\nsaid O\n", r"bad\.txt: every tag is O"),
        "conll-iob1": (
            "bad.txt",
            "Peter I-PER\nBlackburn I-PER\n\nsaid O\n",
            r"bad\.txt is tagged IOB1 but .*valid\.txt IOB2",
        ),
        "jsonl-lengths": (
            "bad.jsonl",
            '{"tokens": ["EU", "rejects"], "ner_tags": ["B-ORG"]}\n',
            r"bad\.jsonl line 1: 2 words but 1 tags",
        ),
        "jsonl-integer-tags": (
            "bad.jsonl",
            '{"tokens": ["EU"], "ner_tags": [3]}\n',
            r"bad\.jsonl line 1: tags must be names",
        ),
        "jsonl-bad-line": ("bad.jsonl", '{"tokens": ["EU"]\n', r"bad\.jsonl line 1 is not valid JSON"),
        "json-no-tokens": (
            "bad.json",
            '[{"ner_tags": ["B-ORG"]}]',
            r"bad\.json has no words column besides its tags column 'ner_tags'.*--tokens_column",
        ),
        "csv": ("bad.csv", "tokens,tags\n", r"bad\.csv: unsupported file type '\.csv'"),
    }
    context = "Ada wrote it."
    qa = {  # replacing bert_qa's --train_file
        "json-truncated": (
            "bad.json",
            '{"data": [{"title": "t", "paragraphs": [',
            r"bad\.json is not valid JSON",
        ),
        "squad-layout": (
            "bad.json",
            '{"data": [{"title": "t", "paragraphs": [{"context": "x"}]}]}',
            r"bad\.json: article 1 paragraph 1 does not follow SQuAD's layout \(KeyError: 'qas'\)",
        ),
        "squad-data-not-at-the-top": (
            "bad.json",
            '{"meta": {"data": []}}',
            r"bad\.json: its 'data' does not follow SQuAD's layout \(KeyError: 'data'\)",
        ),
        "squad-no-questions": ("bad.json", '{"data": []}', r"bad\.json holds no questions"),
        "squad-answer-offset": (
            "bad.json",
            json.dumps(
                {
                    "data": [
                        {
                            "paragraphs": [
                                {
                                    "context": context,
                                    "qas": [
                                        {
                                            "id": "q",
                                            "question": "Who?",
                                            "answers": [{"text": "Ada", "answer_start": 4}],
                                        }
                                    ],
                                }
                            ]
                        }
                    ]
                }
            ),
            r"bad\.json question 1 \(id 'q'\): answer 'Ada' is not at character 4 of the context \(found 'wro'\)",
        ),
        "squad-unanswerable": (
            "bad.json",
            json.dumps(
                {
                    "data": [
                        {
                            "paragraphs": [
                                {"context": context, "qas": [{"id": "q", "question": "Who?", "answers": []}]}
                            ]
                        }
                    ]
                }
            ),
            r"bad\.json question 1 \(id 'q'\) has no answer\. .*--version_2_with_negative",
        ),
        "jsonl-no-answers": (
            "bad.jsonl",
            '{"question": "Who?", "context": "Ada wrote it."}\n',
            r"bad\.jsonl has no column\(s\) \['answers'\].*--answer_column",
        ),
        "jsonl-answers-not-squad": (
            "bad.jsonl",
            '{"question": "Who?", "context": "Ada wrote it.", "answers": "Ada"}\n',
            r"bad\.jsonl question 1 \(id '0'\): answers must be \{\"text\"",
        ),
        "jsonl-not-utf8": ("bad.jsonl", b'{"question": "caf\xe9"}\n', r"bad\.jsonl line 1 is not UTF-8"),
        "txt": ("bad.txt", "Who? Ada", r"bad\.txt: unsupported file type '\.txt'"),
    }
    for recipe, table in (("bert_glue", glue), ("bert_mlm", mlm), ("bert_ner", ner), ("bert_qa", qa)):
        for name, (filename, content, message) in table.items():
            yield Case(f"file:{name}", (recipe,), bad_file("train_file", filename, content), message)
    for label_type, content, message in (
        ("classification", "text,label\na,0.5\nb,1\n", r"bad\.csv row 1: label 0\.5 is not a whole number"),
        ("regression", "text,label\na,low\nb,high\n", r"bad\.csv row 1: regression labels must be numbers"),
    ):

        def breaks(case, flags, content=content, label_type=label_type):
            flags.update(train_file=write(case / "bad.csv", content), label_type=label_type)

        yield Case(f"file:csv-label-type-{label_type}", ("bert_glue",), breaks, message)
    yield Case(
        "file:missing", ALL, setting(train_file="nowhere.json"), r"Data file nowhere\.json does not exist"
    )

    def folder_named_like_a_file(case, flags):
        (case / "folder.csv").mkdir()
        flags["train_file"] = case / "folder.csv"

    yield Case("file:a-folder", BOTH, folder_named_like_a_file, r"folder\.csv is not a file")
    yield Case(
        "file:unseen-validation-tag",
        ("bert_ner",),
        bad_file("validation_file", "valid2.txt", "Acme B-ORG\nsaid O\n\nParis B-LOC\n"),
        r"valid2\.txt line 4: tag 'B-LOC' does not occur in the training data",
    )
    yield Case(
        "file:stride-too-long",
        ("bert_qa",),
        setting(doc_stride=40),
        r"--doc_stride 40 must be smaller than the context part of a window: .* = 29",
    )
    yield Case(
        "file:unseen-validation-label",
        ("bert_glue",),
        bad_file("validation_file", "dev2.csv", "text,label\nhm,neutral\n"),
        r"dev2\.csv: label 'neutral' is not one of \['neg', 'pos'\]",
    )

    def glue_dir(files, message):
        def breaks(case, flags):
            for name, content in files.items():
                write(case / "glue" / "RTE" / name, content)
            flags.update(train_file=None, validation_file=None, task_name="rte", data_dir=case / "glue")

        return breaks

    header = "index\tsentence1\tsentence2\tlabel\n"
    yield Case("glue:no-folder", ("bert_glue",), glue_dir({}, ""), r"No GLUE files for rte under .*glue")
    yield Case(
        "glue:bad-label",
        ("bert_glue",),
        glue_dir({"train.tsv": header + "0\ta\tb\tmaybe\n", "dev.tsv": header + "0\ta\tb\tentailment\n"}, ""),
        r"label 'maybe' is not one of",
    )
    yield Case(
        "glue:empty-dev",
        ("bert_glue",),
        glue_dir({"train.tsv": header + "0\ta\tb\tentailment\n", "dev.tsv": ""}, ""),
        r"dev\.tsv is empty",
    )
    yield Case(
        "glue:missing-column",
        ("bert_glue",),
        glue_dir({"train.tsv": "index\tsentence1\tlabel\n0\ta\tentailment\n", "dev.tsv": header}, ""),
        r"train\.tsv has no column\(s\) \['sentence2'\]",
    )


def numeric_flag_cases():
    """Every numeric flag of every recipe (read from its parser), out of range: -1, and NaN / inf
    for the float ones. The message names the flag."""
    import argparse

    from conftest import load_recipe

    from amp_recipes.arguments import add_shared_args

    shared_parser = argparse.ArgumentParser()
    add_shared_args(shared_parser, output_default="", example="glue")
    shared = {action.dest for action in shared_parser._actions}
    for recipe in ALL:
        parser = load_recipe(recipe).build_parser()
        for action in parser._actions:
            if action.type not in (int, float) or action.choices:
                continue
            if recipe in ("bert_ner", "bert_qa") and action.dest in shared:  # bert_glue's rows test them
                continue
            below_zero = action.dest != "null_score_diff_threshold"  # a negative threshold is a setting
            for value in ["-1"] * below_zero + (["nan", "inf"] if action.type is float else []):
                flag = action.option_strings[0]
                yield Case(
                    f"flag:{flag}={value}", (recipe,), setting(**{flag[2:]: value}), rf"{flag} must be "
                )
    yield Case(
        "flag:not-a-number", ALL, setting(learning_rate="fast"), r"argument --learning_rate: invalid float"
    )
    yield Case(
        "flag:bad-choice", ALL, setting(mixed_precision="fp4"), r"--mixed_precision: invalid choice: 'fp4'"
    )
    yield Case(  # this machine's real device facts: a CPU, refused before any Accelerator or lock exists
        "flag:fp8-without-an-fp8-gpu",
        ALL,
        setting(mixed_precision="fp8"),
        r"fp8 was asked on a cpu \(.*\), but fp8 training needs an NVIDIA GPU of compute capability 8\.9 "
        r"or newer .*; use --mixed_precision (bf16|no) instead\.$",
    )
    yield Case(
        "flag:checkpointing_steps",
        ALL,
        setting(checkpointing_steps="often"),
        r"--checkpointing_steps: must be a positive",
    )


def combination_cases():
    yield Case(
        "combo:task-and-files",
        ("bert_glue",),
        setting(task_name="mrpc"),
        r"use one of --task_name \(GLUE\), --train_file/--validation_file \(your data\) or --dataset_name",
    )
    yield Case(
        "combo:no-validation-file",
        ("bert_glue",),
        setting(validation_file=None),
        r"give --task_name, both --train_file and --validation_file, or --dataset_name",
    )
    yield Case(
        "combo:text-columns-for-glue",
        ("bert_glue",),
        setting(task_name="mrpc", train_file=None, validation_file=None, text_columns="review"),
        r"--text_columns names the columns of --train_file",
    )
    yield Case(
        "combo:train-file-alone",
        ("bert_ner", "bert_qa"),
        setting(validation_file=None),
        r"give both --train_file and --validation_file \(or neither",
    )
    yield Case(
        "combo:compile-and-diagnose", ALL, setting(torch_compile=True, diagnose_overflow=True), "recompile"
    )
    yield Case(
        "combo:checkpointing-and-te-fp8",
        ALL,
        setting(gradient_checkpointing=True, mixed_precision="fp8", fp8_backend="te"),
        r"--gradient_checkpointing with Transformer Engine's fp8 is not supported",
    )
    yield Case("flag:abbreviated", ALL, setting(learning_r=1e-4), r"unrecognized arguments: --learning_r")
    yield Case(
        "combo:test-file-without-do-predict",
        ("bert_glue",),
        setting(test_file="test.csv"),
        r"--test_file holds the examples --do_predict predicts: add --do_predict\.$",
    )
    yield Case(
        "combo:ner-test-file-without-do-predict",
        ("bert_ner",),
        setting(test_file="test.txt"),
        r"--test_file holds the sentences --do_predict tags: add --do_predict\.$",
    )
    yield Case(
        "combo:ner-predict-your-files-without-a-test-file",
        ("bert_ner",),
        setting(do_predict=True),
        r"--do_predict with your own files needs --test_file, the sentences to tag\.$",
    )
    yield Case(
        "combo:qa-predict-without-a-test-file",
        ("bert_qa",),
        setting(do_predict=True),
        r"--do_predict answers the questions of --test_file: give both, or neither\.$",
    )
    yield Case(
        "combo:glue-predict-your-files-without-a-test-file",
        ("bert_glue",),
        setting(do_predict=True),
        r"--do_predict with your own files needs --test_file, the examples to predict\.$",
    )
    yield Case(
        "combo:test-file-for-a-glue-task",
        ("bert_glue",),
        setting(task_name="mrpc", train_file=None, validation_file=None, test_file="t.csv", do_predict=True),
        r"--test_file is your own data's; a GLUE task predicts its own test split\.$",
    )
    yield Case(
        "combo:best-model-without-a-metric",
        ALL,
        setting(load_best_model_at_end=True),
        r"--load_best_model_at_end needs --metric_for_best_model \(e\.g\. accuracy, f1\) to compare evaluations\.$",
    )
    yield Case(
        "combo:early-stopping-without-training",
        ALL,
        setting(metric_for_best_model="f1", early_stopping_patience=2, eval_only=True),
        r"--early_stopping_patience acts on the evaluations of a training run; --eval_only trains nothing\.$",
    )
    yield Case(
        "combo:overwrite-and-resume",
        ALL,
        setting(resume_from_checkpoint="latest"),
        r"--overwrite_output_dir starts the run again, --resume_from_checkpoint continues it",
    )
    yield Case(
        "combo:longer-than-the-model",
        ALL,
        setting(max_seq_length=4096),
        r"longer than the model's limit of 512",
    )


def output_cases():
    def under_a_file(case, flags):
        flags["output_dir"] = write(case / "a-file", "x") / "out"

    def is_a_file(case, flags):
        flags["output_dir"] = write(case / "a-file", "x")

    def without_overwrite(edit=None):
        def breaks(case, flags):
            flags["overwrite_output_dir"] = None
            if edit:
                edit(case / "out")

        return breaks

    def unfinished(out):
        for name in ("eval_results.json", "model.safetensors", "config.json"):
            (out / name).unlink()

    def other_files(out):
        for path in sorted(out.iterdir(), reverse=True):
            if path.is_file():
                path.unlink()
        for folder in ("checkpoints", "epoch_0"):
            shutil.rmtree(out / folder)
        write(out / "notes.txt", "mine")

    def locked(pid, host=None):
        def breaks(case, flags):
            owner = {"pid": pid, "host": host or os.uname().nodename, "started": "earlier"}
            write(case / "out" / LOCK, json.dumps(owner))

        return breaks

    yield Case("output:under-a-file", ALL, under_a_file, r"Cannot create --output_dir .*a-file/out")
    yield Case("output:is-a-file", ALL, is_a_file, r"--output_dir .*a-file is a file")
    yield Case(
        "output:finished-run", ALL, without_overwrite(), r"holds a finished run .*--overwrite_output_dir"
    )
    yield Case(
        "output:unfinished-run",
        ALL,
        without_overwrite(unfinished),
        r"unfinished run .*--resume_from_checkpoint latest",
    )
    yield Case(
        "output:not-empty", ALL, without_overwrite(other_files), r"is not empty \(it holds notes\.txt\)"
    )
    yield Case("output:locked", ALL, locked(1), r"Another run \(PID 1, started earlier\) is using")
    yield Case(
        "output:locked-elsewhere", ALL, locked(4242, "gpu-node-7"), r"locked by PID 4242 on host gpu-node-7"
    )


def model_and_checkpoint_cases():
    def folder_without_config(case, flags):
        (case / "empty-model").mkdir()
        flags["model_name_or_path"] = case / "empty-model"

    yield Case(
        "model:no-such-path",
        ALL,
        setting(model_name_or_path="./no-such-model"),
        r"no-such-model: no such directory",
    )
    yield Case(
        "model:a-file",
        ALL,
        lambda case, flags: flags.update(model_name_or_path=flags["train_file"]),
        r"is a file",
    )
    yield Case("model:no-config", ALL, folder_without_config, r"empty-model has no config\.json")
    yield Case(
        "model:hub-offline",
        ALL,
        setting(model_name_or_path="bert-base-uncased"),
        r"Could not load model .*Offline\?",
    )

    def resume(value, edit=None):
        def breaks(case, flags):
            flags.update(
                overwrite_output_dir=None, resume_from_checkpoint=value(case) if callable(value) else value
            )
            if edit:
                edit(case / "out" / "checkpoints")

        return breaks

    def no_checkpoints(checkpoints):
        for path in sorted(checkpoints.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        checkpoints.rmdir()

    def unreadable_marker(checkpoints):
        write(checkpoints / "checkpoint-1" / "amp_checkpoint.json", "{not json")

    yield Case(
        "checkpoint:missing",
        ALL,
        resume(lambda case: case / "out" / "checkpoints" / "nope"),
        r"Checkpoint .*nope does not exist",
    )
    yield Case(
        "checkpoint:none-yet",
        ALL,
        resume("latest", no_checkpoints),
        r"no complete checkpoint in .*drop the flag",
    )
    yield Case(
        "checkpoint:truncated-file",
        ALL,
        resume("latest"),
        r"is corrupted: model\.safetensors is 3 bytes instead of 11",
    )
    yield Case(
        "checkpoint:unreadable-marker",
        ALL,
        resume("latest", unreadable_marker),
        r"is corrupted: .* not valid JSON",
    )
    yield Case(
        "checkpoint:incomplete",
        ALL,
        resume(
            lambda case: case / "out" / "checkpoints" / "checkpoint-1",
            lambda c: (c / "checkpoint-1" / "amp_checkpoint.json").unlink(),
        ),
        r"is incomplete \(no amp_checkpoint\.json\)",
    )


ALL_CASES = [
    *file_cases(),
    *numeric_flag_cases(),
    *combination_cases(),
    *output_cases(),
    *model_and_checkpoint_cases(),
]
MATRIX = [(recipe, case) for case in ALL_CASES for recipe in case.recipes]


@pytest.mark.parametrize("recipe, case", MATRIX, ids=[f"{recipe}-{case.name}" for recipe, case in MATRIX])
def test_bad_input_is_one_sentence_and_changes_nothing(recipe, case, tmp_path):
    flags = WORKING_RUNS[recipe](tmp_path)
    case.breaks(tmp_path, flags)
    before = checksums(tmp_path, TINY_BERT)
    status, output = run_command_line(RECIPES / f"{recipe}.py", argv_of(flags))
    lines = output.strip().splitlines()
    assert status != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert lines and re.match(ERROR_LINE, lines[-1]), output[-3000:]
    assert re.search(case.message, lines[-1]), lines[-1]
    after = checksums(tmp_path, TINY_BERT)
    assert {path: after.get(path) for path in before} == before  # nothing that was there changed
    assert not list(tmp_path.rglob(LOCK)) or case.name.startswith("output:locked")


def test_the_matrix_covers_every_recipe_and_format():
    recipes = {recipe for recipe, _ in MATRIX}
    assert recipes == {path.stem for path in RECIPES.glob("bert_*.py")}
    formats = {case.name.split(":")[1].split("-")[0] for case in ALL_CASES if case.name.startswith("file:")}
    assert {"csv", "tsv", "json", "jsonl", "txt"} <= formats


@pytest.mark.parametrize("recipe", ALL)
def test_the_working_run_works_over_a_finished_run_with_a_stale_lock(recipe, tmp_path):
    """The matrix's starting point: it trains, replaces the finished run it was pointed at
    (--overwrite_output_dir: the old checkpoints go, epoch_0 too, the model is replaced whole), and takes over
    the lock a killed run left behind, saying so."""
    flags = WORKING_RUNS[recipe](tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write(tmp_path / "out" / LOCK, json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    status, output = run_command_line(RECIPES / f"{recipe}.py", argv_of(flags))
    assert status == 0, output[-3000:]
    assert f"Removing the stale lock {tmp_path / 'out' / LOCK}: PID {int(dead.stdout)}" in output
    out = tmp_path / "out"
    assert not (out / "checkpoints").exists() and not (out / "epoch_0").exists()  # the old run's
    assert (out / "model.safetensors").read_bytes() != b"old weights"
    assert json.loads((out / "eval_results.json").read_text())["train_steps"] == 1
    assert not (out / LOCK).exists() and not (out / ".final.tmp").exists()
    assert math.isfinite(json.loads((out / "log_history.jsonl").read_text().splitlines()[0]).get("loss", 0))


# ----------------------------------------------------------------------------- the launchers
# The documented launcher forms, each a command the docs show (the test finds it there), and what
# this machine changes: two processes on a CPU (ACCELERATE_USE_CPU=1: one gloo group).
LAUNCHERS = {
    "python": ("docs/checkpoints.md", "python recipes/bert_glue.py", {}),
    "one process": (
        "README.md",
        "accelerate launch -q --config_file accelerate_configs/cpu.yaml recipes/bert_glue.py",
        {},
    ),
    "two processes": (
        "docs/scaling-out.md",
        "accelerate launch -q --config_file accelerate_configs/multi_gpu.yaml recipes/bert_glue.py",
        {"ACCELERATE_USE_CPU": "1"},
    ),
}
# What torchrun's agent prints in the launcher process after a rank failed, under `-q` (accelerate
# >= 1.16; 1.15 adds the ChildFailedError traceback): its own log lines, then its failure report
# between two lines of '='. Not the recipe's to change; see docs/fp16.md, "When a run fails".
TORCHRUN_LOG = re.compile(r"^[WE]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/")


def after_the_preflight(output: str) -> list[str]:
    """The lines after the preflight's `Preflight` line, less its own indented lines (with several
    processes another rank's line may come between them)."""
    lines = output.splitlines()
    start = next(index for index, line in enumerate(lines) if line.endswith("] Preflight"))
    return [line for line in lines[start + 1 :] if not line.startswith("  ")]


def without_torchruns_report(lines: list[str]) -> list[str]:
    """`lines` less torchrun's log lines and its failure report, which must come last."""
    kept = [line for line in lines if not TORCHRUN_LOG.match(line)]
    first = kept.index("=" * 60)
    assert kept[first + 1].endswith("recipes/bert_glue.py FAILED") and kept[-1] == "=" * 60, kept[first:]
    assert "Root Cause (first observed failure):" in kept[first:]
    return [line for line in kept[:first] if line.strip()]


@pytest.mark.heavy  # three launches, one of two processes
@pytest.mark.parametrize("form", LAUNCHERS)
def test_a_failed_run_says_why_once_in_every_documented_launcher_form(form, tmp_path):
    """A missing model folder through each documented launcher: exit 1, the cause once, no
    traceback, at most 3 lines after the preflight. With two processes both ranks fail the same
    check and the sentence is still printed once (amp_recipes.errors.first_to_say); what follows it
    is torchrun's own report, which the launcher prints for any failed rank. There, a bad flag
    value (argparse, before any preflight) also prints its usage and error once."""
    from conftest import GLUE_DIR, REPO, accelerate_launch, run

    page, launcher, env = LAUNCHERS[form]
    assert launcher in (REPO / page).read_text().replace("\\\n    ", "")  # the docs show this form
    missing = tmp_path / "no-such-model"
    flags = ["--task_name", "mrpc", "--data_dir", GLUE_DIR, "--model_name_or_path", missing]
    flags += ["--output_dir", tmp_path / "out"]
    words = launcher.split()
    if form == "python":
        command = [sys.executable, *words[1:], *flags]
    else:
        processes = ["--num_processes", 2] if form == "two processes" else []
        command = accelerate_launch(*words[2:-1], *processes, words[-1], *flags)
    result = run(command, tmp_path, **env)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    sentence = f"error: --model_name_or_path {missing}: no such directory (a Hub model id looks like"
    assert [line for line in output.splitlines() if line.startswith(sentence)] != []
    assert output.count(sentence) == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    after = after_the_preflight(output)
    if form == "two processes":
        # The ranks write to the terminal independently: the rank that prints the sentence may
        # do so before rank 0's preflight ends, or between its lines.
        assert len(without_torchruns_report(after)) <= 3, after
    else:
        assert len(after) <= 3 and after[-1].startswith(sentence), after
    assert not (tmp_path / "out").exists()

    if form == "two processes":
        flags[flags.index("--model_name_or_path") + 1] = "prajjwal1/bert-tiny"  # never reached
        result = run(
            accelerate_launch(*words[2:-1], *processes, words[-1], *flags, "--learning_rate", -1),
            tmp_path,
            **env,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 1
        assert output.count("bert_glue.py: error: --learning_rate must be at least 0, not -1.0.") == 1, output
        assert output.count("usage: bert_glue.py") == 1 and "Traceback" not in output
