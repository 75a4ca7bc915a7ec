"""Read back what an offline W&B run recorded, for tests.

Recent wandb clients write offline runs only to `run-<id>.wandb`, a LevelDB-style log of
protobuf `Record`s (no files/config.yaml until synced), so tests decode it here.
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B" + 2-byte magic + 1-byte version; each record has crc(4) length(2) type(1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_records(path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending, records = _HEADER, b"", []
    while position + 7 <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < 7:  # block trailer padding
            position += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def run_file(wandb_dir, run_dir=None) -> Path:
    pattern = "run-*.wandb" if run_dir else "wandb/offline-run-*/run-*.wandb"
    run_files = list(Path(run_dir or wandb_dir).glob(pattern))
    assert len(run_files) == 1, run_files
    return run_files[0]


def offline_summary(wandb_dir, run_dir=None) -> dict:
    """The run summary as the run last set it (its `summary` records, in order: updates and removals)."""
    summary = {}
    for record in read_records(run_file(wandb_dir, run_dir)):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            for item in record.summary.remove:
                summary.pop(item.key or "/".join(item.nested_key), None)
    return summary


def offline_run(wandb_dir, run_dir=None):
    """The single offline run under `wandb_dir` (or the run in `run_dir`): its run record,
    config and history rows."""
    run, config, history = None, {}, []
    for record in read_records(run_file(wandb_dir, run_dir)):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            # Newer clients fill nested_key instead of key.
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return run, config, history
