"""The Hugging Face Hub: the model card every run writes beside its model, and `--push_to_hub`.

The card is the README.md of the output folder, as the Hub shows it: the task, the data, the
model it started from, the precision that really ran, the hyperparameters, the command, and the
dev results, also as `model-index` metadata (huggingface_hub's `ModelCardData`), which the Hub
reads into its evaluation widget. `--push_to_hub` uploads the folder (without its checkpoints)
once the final model is saved; an upload that cannot work (offline, no token, a token the Hub
refuses) is refused before training starts.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from .errors import InputError

TASK_TYPES = {  # the model's head (its class name ends with it) -> the Hub's task and pipeline tag
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForMaskedLM": "fill-mask",
}
GLUE_DATASET = "nyu-mll/glue"
NOT_SCORES = ("_samples", "_runtime", "_windows")  # counts and times among the eval_* figures
HYPERPARAMETERS = [
    "learning_rate",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_train_epochs",
    "max_train_steps",
    "lr_scheduler_type",
    "warmup_ratio",
    "num_warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "max_seq_length",
    "seed",
    "mixed_precision",
    "gradient_checkpointing",
    "torch_compile",
]
# The run's checkpoints, its lock and a save in progress stay local (outputs.LOCK, FINAL_STAGING).
UPLOAD_IGNORED = ["checkpoints/**", ".amp-recipes.lock", ".final.tmp/**"]


# ----------------------------------------------------------------------------- --push_to_hub
def check_push_to_hub(args) -> None:
    """Before training: refuse a --push_to_hub that cannot work, in one sentence."""
    if not getattr(args, "push_to_hub", False):
        return
    from huggingface_hub import HfApi, get_token, is_offline_mode

    if is_offline_mode():
        raise InputError(
            "--push_to_hub needs the Hugging Face Hub, and HF_HUB_OFFLINE is set: unset it to upload, "
            "or drop --push_to_hub (the model is saved in --output_dir either way)."
        )
    token = args.hub_token or get_token()
    if not token:
        raise InputError(
            "--push_to_hub needs a Hugging Face token with write access: run `hf auth login`, set HF_TOKEN, "
            "or pass --hub_token."
        )
    try:
        HfApi(token=token).whoami()
    except Exception as error:  # noqa: BLE001 - a refused token, no network: said before training
        raise InputError(
            f"--push_to_hub: the Hub did not accept the token or could not be reached "
            f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); check the token "
            "(`hf auth whoami`) and the network, or drop --push_to_hub."
        ) from error


def repo_id(args) -> str:
    """--hub_model_id, else the output folder's name (under your user on the Hub)."""
    return args.hub_model_id or Path(args.output_dir).resolve().name


def push_to_hub(folder: Path, args) -> str:
    """Upload the finished output folder, checkpoints left out; returns the repo's URL."""
    from huggingface_hub import HfApi, get_token

    api = HfApi(token=args.hub_token or get_token())
    try:
        repo = api.create_repo(repo_id(args), exist_ok=True).repo_id
        api.upload_folder(
            repo_id=repo,
            folder_path=folder,
            commit_message="amp-recipes: fine-tuned model",
            ignore_patterns=UPLOAD_IGNORED,
        )
    except Exception as error:  # noqa: BLE001 - the model is saved; say how to upload it again
        raise InputError(
            f"The model is saved in {folder}, but the upload to the Hub failed "
            f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); upload it with "
            f"`hf upload {repo_id(args)} {folder} --exclude 'checkpoints/*'`."
        ) from error
    return f"https://huggingface.co/{repo}"


def redacted(config: dict) -> dict:
    """A run config safe to log and send to trackers: the Hub token replaced."""
    return {**config, "hub_token": "<redacted>"} if config.get("hub_token") else config


# ----------------------------------------------------------------------------- the model card
def task_type(model) -> str | None:
    name = type(model).__name__
    return next((task for head, task in TASK_TYPES.items() if name.endswith(head)), None)


def dataset_of(args, identity: dict) -> dict:
    """The data the model was fine-tuned on, as the card's metadata names it."""
    if getattr(args, "train_file", None):
        return {"name": f"your data ({Path(args.train_file).name})", "type": "custom"}
    task = identity.get("task_name")
    if getattr(args, "task_name", None):  # GLUE, from the Hub or a GLUE folder
        return {"name": f"GLUE {task.upper()}", "type": GLUE_DATASET, "config": task}
    if getattr(args, "dataset_name", None):  # NER
        return {"name": args.dataset_name, "type": args.dataset_name}
    if task in ("squad", "squad_v2"):
        from .qa import HUB_DATASETS

        dataset = HUB_DATASETS[task == "squad_v2"]
        return {"name": dataset, "type": dataset}
    return {"name": str(task or "unknown"), "type": "custom"}


def command_line() -> str:
    """The recipe's command line as this process received it, the Hub token hidden."""
    argv = ["python", *sys.argv]
    for index, word in enumerate(argv[:-1]):
        if word == "--hub_token":
            argv[index + 1] = "<redacted>"
    argv = [word.split("=")[0] + "=<redacted>" if word.startswith("--hub_token=") else word for word in argv]
    return shlex.join(argv)


def model_card(model, args, summary: dict, identity: dict):
    """huggingface_hub's ModelCard for the run: metadata (model-index with the dev scores) and text."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    task = task_type(model)
    data = dataset_of(args, identity)
    scores = {
        key.removeprefix("eval_"): value
        for key, value in summary.items()
        if key.startswith("eval_")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not any(part in key for part in NOT_SCORES)
    }
    base = args.model_name_or_path
    on_hub = not Path(base).expanduser().exists()  # a Hub id, not a local folder
    name = repo_id(args)
    card_data = ModelCardData(
        model_name=name,
        base_model=base if on_hub else None,
        datasets=[data["type"]] if data["type"] != "custom" else None,
        library_name="transformers",
        pipeline_tag=task,
        tags=["amp-recipes", "mixed-precision", summary.get("precision_in_effect", "fp32")],
        eval_results=[
            EvalResult(
                task_type=task or "other",
                dataset_type=data["type"],
                dataset_name=data["name"],
                dataset_config=data.get("config"),
                dataset_split="validation",
                metric_type=metric,
                metric_value=value,
            )
            for metric, value in scores.items()
        ]
        or None,
    )
    recipe = Path(sys.argv[0]).name
    where = name if args.push_to_hub else args.output_dir  # the Hub repo, or the local folder
    hyperparameters = {key: getattr(args, key) for key in HYPERPARAMETERS if hasattr(args, key)}
    hyperparameters.update(
        total_train_batch_size=summary.get("total_train_batch_size"),
        optimizer=summary.get("optimizer"),
        train_steps=summary.get("train_steps"),
        num_processes=summary.get("num_processes"),
        distributed_type=summary.get("distributed_type"),
    )
    lines = [
        "---",
        card_data.to_yaml(),
        "---",
        "",
        f"# {name}",
        "",
        f"{base} fine-tuned for {task or 'its task'} on {data['name']} with `{recipe}` of "
        f"amp-recipes, in **{summary.get('precision_in_effect', 'fp32')}** "
        f"(asked: {summary.get('mixed_precision_requested') or 'the launcher default'}; chosen by "
        f"{summary.get('mixed_precision_source', 'unknown')}).",
        "",
        "## Dev results",
        "",
        "| metric | value |",
        "|---|---|",
        *(f"| {metric} | {value:.4g} |" for metric, value in scores.items()),
        "",
        "## Training",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in hyperparameters.items() if value is not None),
        "",
        "Command (each process of the launch ran it):",
        "",
        "```bash",
        command_line(),
        "```",
        "",
        "## Use it",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        f'model = pipeline("{task or "feature-extraction"}", model="{where}")',
        "```",
        "",
    ]
    return ModelCard("\n".join(lines))
