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

from transformers import PreTrainedModel

from amp_recipes.errors import InputError

TASK_TYPES = {  # the model's head (its class name ends with it) -> the Hub's task and pipeline tag
    "ForSequenceClassification": "text-classification",
    "ForTokenClassification": "token-classification",
    "ForQuestionAnswering": "question-answering",
    "ForMaskedLM": "fill-mask",
}
GLUE_DATASET = "nyu-mll/glue"
# Counts and times among the eval_* figures (SQuAD v2's totals, the masked LM's token count ...).
NOT_SCORES = ("_samples", "_samples_mm", "_runtime", "_windows", "total", "_tokens")
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
def hide_token(args) -> None:
    """--hub_token's value out of sys.argv, which W&B records with each run (and the model card
    quotes): replaced there by <redacted>. The process list (`ps`) shows it while the run lives,
    so HF_TOKEN or `hf auth login` are the better ways to give it."""
    if getattr(args, "hub_token", None):
        sys.argv[:] = [word.replace(args.hub_token, "<redacted>") for word in sys.argv]


def create_repo(args) -> str | None:
    """--push_to_hub, before training: the Hub repo created (or found), as transformers' Trainer
    does, so that offline, no token, or a token without write access stops the run now, in one
    sentence. Returns the repo's full id (owner/name); None without --push_to_hub."""
    if not getattr(args, "push_to_hub", False):
        return None
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
        return HfApi(token=token).create_repo(repo_name(args), exist_ok=True).repo_id
    except Exception as error:  # noqa: BLE001 - a refused token, no network: said before training
        raise InputError(
            f"--push_to_hub: could not create or find the Hub repo {repo_name(args)!r} "
            f"({first_line(error)}); check the token's write access (`hf auth whoami`) and the network, "
            "or drop --push_to_hub."
        ) from error


def repo_name(args) -> str:
    """--hub_model_id, else the output folder's name (the Hub puts it under your user)."""
    return args.hub_model_id or Path(args.output_dir).resolve().name


def push_to_hub(repo: str, folder: Path, args) -> str:
    """Upload the finished output folder to `repo`, checkpoints left out; returns its URL."""
    from huggingface_hub import HfApi, get_token

    try:
        HfApi(token=args.hub_token or get_token()).upload_folder(
            repo_id=repo,
            folder_path=folder,
            commit_message="amp-recipes: fine-tuned model",
            ignore_patterns=UPLOAD_IGNORED,
        )
    except Exception as error:  # noqa: BLE001 - the model is saved; say how to upload it again
        raise InputError(
            f"The model is saved in {folder}, but the upload to {repo} failed ({first_line(error)}); "
            f"upload it with `hf upload {repo} {folder} --exclude 'checkpoints/*'`."
        ) from error
    return f"https://huggingface.co/{repo}"


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error).strip() else type(error).__name__


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
        from amp_recipes.tasks.qa import HUB_DATASETS

        dataset = HUB_DATASETS[task == "squad_v2"]
        return {"name": dataset, "type": dataset}
    return {"name": str(task or "unknown"), "type": "custom"}


def command_line() -> str:
    """The recipe's command line as this process received it (hide_token has taken the token out)."""
    return shlex.join(["python", *sys.argv])


def split_of(metric: str, dataset: dict) -> tuple[str, str]:
    """(metric, split): MNLI's `accuracy_mm` is accuracy on validation_mismatched, its plain
    accuracy on validation_matched; every other task's dev split is `validation`."""
    if dataset.get("config") == "mnli":
        if metric.endswith("_mm"):
            return metric.removesuffix("_mm"), "validation_mismatched"
        return metric, "validation_matched"
    return metric, "validation"


def model_card(model, args, summary: dict, identity: dict, hub_repo: str | None = None):
    """huggingface_hub's ModelCard for the run: metadata (model-index with the dev scores) and text."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    task = task_type(model)
    transformers_model = isinstance(model, PreTrainedModel)  # else a model of your own: its weights only
    data = dataset_of(args, identity)
    scores = {
        key.removeprefix("eval_"): value
        for key, value in summary.items()
        if key.startswith("eval_")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not key.endswith(NOT_SCORES)
    }
    base = args.model_name_or_path
    on_hub = not Path(base).expanduser().exists()  # a Hub id, not a local folder
    name = hub_repo or repo_name(args)
    card_data = ModelCardData(
        model_name=name,
        base_model=base if on_hub else None,
        datasets=[data["type"]] if data["type"] != "custom" else None,
        library_name="transformers" if transformers_model else None,
        pipeline_tag=task,
        tags=["amp-recipes", "mixed-precision", summary.get("precision_in_effect", "fp32")],
        # model-index names a Hub dataset: none for your own data (the text's table has its scores).
        eval_results=[
            EvalResult(
                task_type=task or "other",
                dataset_type=data["type"],
                dataset_name=data["name"],
                dataset_config=data.get("config"),
                dataset_split=split_of(metric, data)[1],
                metric_type=split_of(metric, data)[0],
                metric_value=value,
            )
            for metric, value in scores.items()
        ]
        if data["type"] != "custom" and scores
        else None,
    )
    recipe = Path(sys.argv[0]).name
    where = hub_repo or args.output_dir  # the Hub repo it is pushed to, or the local folder
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
        *(
            [
                "from transformers import pipeline",
                "",
                f'model = pipeline("{task or "feature-extraction"}", model="{where}")',
            ]
            if transformers_model
            else [
                "from safetensors.torch import load_model",
                *(["from huggingface_hub import hf_hub_download"] if hub_repo else []),
                "",
                f"model = {type(model).__name__}(...)  # built as {recipe} builds it, from {base}",
                f'load_model(model, hf_hub_download("{hub_repo}", "model.safetensors"))'
                if hub_repo
                else f'load_model(model, "{where}/model.safetensors")',
            ]
        ),
        "```",
        "",
    ]
    return ModelCard("\n".join(lines))
