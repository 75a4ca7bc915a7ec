"""Test-only: a census of Python processes. Python runs this file at start-up in every process whose
PYTHONPATH holds this folder; each appends its PID, its parent's and its command line to the file
named by $AMP_PROCESS_CENSUS (tests/scripts/test_gpu_check.py counts the GPU check's processes).
It changes nothing else, and then runs the next sitecustomize on the path (another test seam's)."""

import os
from pathlib import Path


def record() -> None:
    census = os.environ.get("AMP_PROCESS_CENSUS")
    if census:
        command = (
            Path("/proc/self/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .replace(b"\n", b" ")
            .decode(errors="replace")
        )
        with open(census, "a") as file:  # one short write per process: lines do not interleave
            file.write(f"{os.getpid()} {os.getppid()} {command.strip()}\n")


def run_the_next_sitecustomize() -> None:
    """The next test seam on the path, through tests/cpu_engines' chain."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "cpu_engines" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("cpu_engines_seam", path)
    seams = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seams)
    seams.run_the_next_sitecustomize(here=Path(__file__).resolve().parent)


if __name__ == "sitecustomize":
    record()
    run_the_next_sitecustomize()
