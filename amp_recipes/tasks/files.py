"""Where a task's data comes from: a user's data file (existence, UTF-8, the format its suffix
names, and one `InputError` naming the file and the line when it cannot be read) or a Hub dataset
(one `InputError` naming it, and how to work offline instead). Shared by every task module
(`classification`, `mlm`, `ner`, `qa`), which add their own column and label checks."""

from __future__ import annotations

import codecs
import csv
import json
import os
from pathlib import Path

import datasets

from amp_recipes.errors import InputError

FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json"}


def check_file(path: str) -> None:
    if not os.path.exists(path):
        raise InputError(f"Data file {path} does not exist.")
    if not os.path.isfile(path):
        raise InputError(f"Data file {path} is not a file.")
    if os.path.getsize(path) == 0:
        raise InputError(f"Data file {path} is empty.")
    # UTF-8 checked before datasets reads the file (one fast pass): arrow keeps the bad bytes of a
    # JSON string and fails only later, when the text is used.
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as handle:
        try:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise InputError(f"{path} {_first_bad_line(path, '.txt')}.") from None


def _first_bad_line(path: str, suffix: str) -> str | None:
    """Why the file cannot be read, with its line number (bytes that are not UTF-8, a JSON Lines
    line that is not an object); read line by line only once something has failed."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                byte = raw[error.start : error.start + 1].hex()
                return f"line {number} is not UTF-8 text (byte 0x{byte}); save the file as UTF-8"
            if suffix == ".jsonl" and line.strip():
                try:
                    row = json.loads(line)
                except ValueError as error:
                    return f"line {number} is not valid JSON ({error})"
                if not isinstance(row, dict):
                    return f"line {number} is not a JSON object with one field per column"
    if suffix == ".json":
        try:
            json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as error:
            return f"is not valid JSON ({error})"
    return None


def _longer_row(path: str, delimiter: str) -> str:
    """The first row with more fields than the header (pandas would take the extras as an index)."""
    with open(path, newline="", encoding="utf-8-sig") as handle:
        rows = csv.reader(handle, delimiter=delimiter)
        header = next(rows)
        for number, row in enumerate(rows, start=2):
            if len(row) > len(header):
                return (
                    f"line {number} has {len(row)} fields, its header {len(header)}; quote the fields "
                    f"that contain the delimiter {delimiter!r}"
                )
    return "has rows with more fields than its header"


def read_file(builder: str, path: str, suffix: str, cache_dir: str | None, **kwargs) -> datasets.Dataset:
    """datasets' reader; a file it cannot read is one InputError naming the file and the line."""
    check_file(path)
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its ERROR line before raising: ours says it
    try:
        table = datasets.load_dataset(
            builder, data_files={"data": path}, split="data", cache_dir=cache_dir, **kwargs
        )
    except Exception as error:  # pandas, arrow and datasets errors come in many types
        problem = _first_bad_line(path, suffix)
        if problem is None:
            cause = error
            while cause.__cause__ is not None:
                cause = cause.__cause__
            empty = "no data" in str(cause) or type(cause).__name__ in ("EmptyDataError", "StopIteration")
            problem = "holds no rows" if empty else f"could not be read ({str(cause).splitlines()[0]})"
        raise InputError(f"{path} {problem}.") from error
    finally:
        datasets.logging.set_verbosity(verbosity)
    return table


def load_user_file(path: str, cache_dir: str | None, builders=FILE_BUILDERS) -> datasets.Dataset:
    suffix = Path(path).suffix.lower()
    if suffix not in builders:
        raise InputError(f"{path}: unsupported file type {suffix!r}; use {', '.join(builders)}.")
    kwargs = {"delimiter": "\t"} if suffix == ".tsv" else {}
    if suffix in (".csv", ".tsv"):
        kwargs["na_filter"] = False  # keep "NA"/"null" texts as text
    table = read_file(builders[suffix], path, suffix, cache_dir, **kwargs)
    if "__index_level_0__" in table.column_names:  # pandas' reading of rows longer than the header
        raise InputError(f"{path} {_longer_row(path, kwargs.get('delimiter', ','))}.")
    if table.num_rows == 0:
        raise InputError(f"{path} holds no rows.")
    other = {".tsv": ",", ".csv": "\t"}.get(suffix)
    if len(table.column_names) == 1 and other and other in table.column_names[0]:
        kind = "tab-separated" if suffix == ".tsv" else "comma-separated"
        raise InputError(
            f"{path} has a single column {table.column_names[0]!r}: {suffix} files are read as {kind}; "
            f"name the file after its delimiter (.csv for commas, .tsv for tabs)."
        )
    return table


def load_hub_dataset(name: str, *config: str, what: str | None = None, offline: str, **kwargs):
    """`datasets.load_dataset(name, *config, **kwargs)` from the Hub; any failure is one InputError
    that names the dataset (`what`, default `name`) and says, in `offline`, how to work from local
    files instead."""
    try:
        return datasets.load_dataset(name, *config, **kwargs)
    except Exception as error:  # connection, offline-mode and missing-cache errors differ by version
        raise InputError(
            f"Could not load {what or name} from the Hugging Face Hub ({type(error).__name__}). Offline? {offline}"
        ) from error
