"""notebooks/mixed_precision_walkthrough.ipynb runs top to bottom on CPU, within CI's 3 minutes,
and is stored without outputs."""

import time

import nbformat
from conftest import REPO, TINY_BERT, missing_tool

NOTEBOOK = REPO / "notebooks" / "mixed_precision_walkthrough.ipynb"


def test_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def test_notebook_runs_top_to_bottom_on_cpu(tmp_path, monkeypatch):
    try:
        import nbclient
    except ImportError:
        missing_tool("nbclient")
    for name, value in {
        "AMP_MODEL": TINY_BERT,
        "AMP_RUNS_DIR": tmp_path,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_EVALUATE_OFFLINE": "1",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }.items():
        monkeypatch.setenv(name, str(value))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.perf_counter()
    nbclient.NotebookClient(
        notebook,
        timeout=170,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO / "notebooks")}},
    ).execute()
    assert time.perf_counter() - started < 180  # the budget for CI

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "--mixed_precision auto ->" in text and "device_type" in text
    assert "no: fp32 in effect" in text
    assert text.count(" in effect, ") >= 4  # two fine-tunes and two benchmark arms
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(figures) == 2  # loss curves, memory/throughput bars
    assert (tmp_path / "benchmark" / "results.json").is_file()
    assert (tmp_path / "mrpc-no" / "eval_results.json").is_file()
