"""scripts/gpu_check.sh, as docs/gpu-check.md says to run it: its dry run on this CPU, each part's
verdict and what a GPU user reads back (summary.json, summary.md, pytest.xml, the doctor's and the
paired runs' reports). CI's floor stage runs the dry run on a fresh virtualenv set up with only
what the docs say (requirements.txt, then the [gpu-check] extra)."""

import json
import sys
import xml.etree.ElementTree as ElementTree

import pytest
from conftest import REPO, load_module, run

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)

CHECK = ["bash", REPO / "scripts" / "gpu_check.sh"]


def test_the_dry_run_reads_ok_with_every_part_and_its_figures(tmp_path):
    out = tmp_path / "check"
    result = run([*CHECK, "--dry_run", "--output_dir", out], tmp_path, timeout=600, PYTHON=sys.executable)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "ok" and summary["dry_run"] is True
    assert list(summary["parts"]) == ["suite", "doctor", "paired"]
    assert all(part["ok"] for part in summary["parts"].values()), summary["parts"]
    # The suite: collected whole, every test skipped by its accelerate.test_utils decorator.
    cases = list(ElementTree.parse(out / "pytest.xml").getroot().iter("testcase"))
    assert len(cases) >= 15 and all(case.find("skipped") is not None for case in cases)
    reasons = {case.find("skipped").get("message") for case in cases}
    assert reasons == {"test requires a GPU", "test requires multiple GPUs"}, reasons
    assert summary["parts"]["suite"]["skipped"] == len(cases)
    # The doctor timed each precision a CPU runs; the paired runs compared bf16 with fp32.
    assert set(summary["parts"]["doctor"]["speed"]) == {"fp32", "bf16"}
    assert (out / "doctor" / "doctor.md").read_text().startswith("#")
    paired = summary["parts"]["paired"]
    assert paired["arm"] == "bf16" and paired["speedup"] > 0
    assert set(paired["metrics"]) == {"eval_accuracy", "eval_f1"}
    comparison = json.loads((out / "paired" / "comparison.json").read_text())
    assert comparison["per_arm"]["bf16"]["precision_in_effect"] == ["bf16"]
    markdown = (out / "summary.md").read_text()
    assert markdown.startswith("# GPU check: ok")
    assert "| suite | ok |" in markdown and "| doctor | ok |" in markdown and "| paired | ok |" in markdown
    assert f"speedup {paired['speedup']:.2f}x" in markdown
    assert not list(out.glob(".*.tmp"))  # every summary written aside was renamed


def test_a_suite_with_no_gpu_to_run_on_reads_not_ok(tmp_path):
    """Without --dry_run a CPU has no CUDA: every test skips, and that is no verdict of ok."""
    out = tmp_path / "check"
    result = run(
        [*CHECK, "--parts", "suite", "--output_dir", out], tmp_path, timeout=300, PYTHON=sys.executable
    )
    assert result.returncode == 1, result.stdout[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "NOT OK"
    assert summary["parts"]["suite"]["why"] == "no test ran: no CUDA GPU"
    assert "| suite | NOT OK: no test ran: no CUDA GPU |" in (out / "summary.md").read_text()


def test_a_part_that_crashes_reads_not_ok_and_the_next_part_still_runs(tmp_path, monkeypatch):
    """--parts in any order, repeated, runs each part once in the check's order; a part that raises
    is that part's verdict, with its error, and the parts after it run."""
    check = load_module(REPO / "scripts" / "gpu_check.py")
    assert check.parse_args(["--parts", "paired,suite,paired", "--output_dir", "x"]).parts == [
        "suite",
        "paired",
    ]
    with pytest.raises(SystemExit):  # argparse's error line, exit 2
        check.parse_args(["--parts", "suite,tests", "--output_dir", "x"])

    def crash(args, out, work):
        raise RuntimeError("no such model")

    def finish(args, out, work):
        return {"ok": True, "why": "", "seconds": 0.0}

    monkeypatch.setattr(check, "suite", crash)
    monkeypatch.setattr(check, "paired", finish)
    assert check.main(["--parts", "suite,paired", "--output_dir", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] == "NOT OK" and summary["parts"]["paired"]["ok"] is True
    assert summary["parts"]["suite"]["why"] == "crashed: RuntimeError: no such model"
    assert "| suite | NOT OK: crashed: RuntimeError: no such model |" in (tmp_path / "summary.md").read_text()
