"""What every task shares between its tokenised data and the training loop: the first N rows,
the tokenizer's length check, padding to a multiple of 8 (16 for fp8), the DataLoader settings and
the length-grouped sampler."""

from __future__ import annotations

import signal

import datasets
import torch

from amp_recipes.errors import InputError


def first_rows(table: datasets.Dataset, limit: int | None) -> datasets.Dataset:
    """The first `limit` rows (all of them when `limit` is None): --max_train/eval_samples."""
    return table.select(range(min(limit, table.num_rows))) if limit else table


def check_max_length(tokenizer, max_seq_length: int) -> None:
    if max_seq_length > tokenizer.model_max_length:
        raise InputError(
            f"--max_seq_length {max_seq_length} is longer than the model's limit of {tokenizer.model_max_length}."
        )


def pad_multiple(mixed_precision: str) -> int | None:
    """Tensor Cores run fp16/bf16 matmuls fastest on dimensions that are multiples of 8, so
    reduced-precision batches are padded up to one; fp32 pads to the longest sequence. fp8 matmuls
    (torch._scaled_mm) need multiples of 16, and batch x sequence is the inner dimension of the
    weight gradient's: padded here, torchao need not pad every one of those matmuls itself."""
    if mixed_precision == "fp8":
        return 16
    return 8 if mixed_precision in ("fp16", "bf16") else None


def loader_settings(accelerator, collator, num_workers: int | None) -> dict:
    """DataLoader keyword arguments shared by a recipe's loaders: on CUDA, pinned memory and (by
    default) 2 worker processes that build batches while the GPU computes; none elsewhere."""
    on_cuda = accelerator.device.type == "cuda"
    num_workers = num_workers if num_workers is not None else 2 * on_cuda
    return {
        "collate_fn": collator,
        "pin_memory": on_cuda,
        "num_workers": num_workers,
        "persistent_workers": num_workers > 0,  # no worker restart each epoch
        "worker_init_fn": leave_stop_signals_to_the_run if num_workers > 0 else None,
    }


def leave_stop_signals_to_the_run(worker_id: int) -> None:
    """In each DataLoader worker: ignore SIGINT and SIGTERM, which the training process handles
    (a checkpoint, then exit). Ctrl-C, Slurm and `kill -- -PGID` signal the whole process group,
    workers included, and launchers pass the signal on to every descendant; a worker ended by it
    makes the training process fail at its next batch ("DataLoader worker ... is killed by
    signal") before the checkpoint it was stopping for. The workers still end with the run: its
    DataLoader tells them to, and a launcher's SIGKILL reaches them too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def train_sampler(dataset, batch_size: int, group_by_length: bool, seed: int):
    """None (the DataLoader shuffles) or a sampler that batches sequences of similar length.

    Grouping cuts padding, hence wasted compute, at the price of less random batches.
    """
    if not group_by_length:
        return None
    return LengthGroupedBatches([len(ids) for ids in dataset["input_ids"]], batch_size, seed)


def by_length(dataset) -> list[int]:
    """The rows' indices, shortest to longest: an evaluation order whose batches pad little."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    return sorted(range(len(lengths)), key=lengths.__getitem__)


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Indices in batches of similar length, the batches in random order.

    transformers' LengthGroupedSampler (the Trainer's --group_by_length) sorts each "megabatch" of
    up to 50 batches longest first and keeps that order, so every epoch trains in runs of long to
    short batches and its last steps, as the learning rate reaches 0, see only short sequences.
    This sampler cuts the same megabatches (the same size rule) but shuffles the batches, keeping
    only the longest batch first (an out-of-memory error shows at the first step, as there: the
    epoch's longest row is always in it).
    Reseeded from (seed, epoch) like accelerate's seedable sampler, so a run resumed mid-epoch
    sees the same batches as an uninterrupted one. Every batch but the epoch's last is full: the
    DataLoader cuts this stream into batches of `batch_size` in order.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0
        # transformers.trainer_pt_utils.get_length_grouped_indices' megabatch size
        self.window = max(1, min(len(lengths) // (batch_size * 4), 50)) * batch_size

    def set_epoch(self, epoch: int) -> None:  # accelerate's DataLoaderShard calls it each epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        batches = []
        for start in range(0, len(order), self.window):
            window = sorted(order[start : start + self.window], key=self.lengths.__getitem__)
            batches += [window[i : i + self.batch_size] for i in range(0, len(window), self.batch_size)]
        # Only the epoch's last window can end in a short batch; it stays last.
        last = [batches.pop()] if batches and len(batches[-1]) < self.batch_size else []
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        if batches:
            longest = max(range(len(batches)), key=lambda b: max(self.lengths[i] for i in batches[b]))
            batches.insert(0, batches.pop(longest))
            first, length = batches[0], self.lengths.__getitem__
            if last and max(map(length, last[0])) > max(map(length, first)):
                # The epoch's longest row fell in its short last batch: it trades places with the
                # first batch's shortest row (as transformers' sampler does), so the first is longest.
                i, j = last[0].index(max(last[0], key=length)), first.index(min(first, key=length))
                last[0][i], first[j] = first[j], last[0][i]
        return (index for batch in batches + last for index in batch)
