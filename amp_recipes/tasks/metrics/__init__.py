"""The `evaluate` metric modules shipped in this package (one folder each), so evaluation works offline."""

from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).parent


def load_metric(name: str, config_name: str | None = None):
    """The shipped metric `name` (e.g. "glue") with its config (e.g. "mrpc"), kept in memory."""
    return evaluate.load(str(METRICS_DIR / name), config_name, keep_in_memory=True)
