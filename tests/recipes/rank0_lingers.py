"""Test helper: rank 0 goes on working after its last collective, its peer watch still running,
while rank 1 has finished and its process is gone, as rank 0 does when it alone writes the
prediction files of --do_predict.

    LINGER_REPORT=file accelerate launch ... tests/recipes/rank0_lingers.py recipes/bert_glue.py ...

Rank 0 waits, after its predictions, until rank 1's process is gone, then for longer than the
watch needs to see it and give up (POLL_S + GRACE_S, and a second more); it writes to
LINGER_REPORT whether rank 1 was gone while its watch was still running. The recipe is otherwise
run as it is."""

import os
import runpy
import sys
import time
from pathlib import Path

from amp_recipes.training import peers, run

real_predictions = run.TrainingRun._predictions


def predictions_then_linger(self):
    counts = real_predictions(self)
    if self.accelerator.process_index == 0:
        where, pid, start = self.peers._peer(1)  # as rank 1 registered itself
        deadline = time.monotonic() + 60
        while peers.process_start(pid) == start and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = peers.process_start(pid) != start
        time.sleep(peers.POLL_S + peers.GRACE_S + 1)  # the watch looks meanwhile, and must not end this rank
        watching = not self.peers.stopped.is_set() and self.peers.thread.is_alive()
        Path(os.environ["LINGER_REPORT"]).write_text(f"rank 1 gone: {gone}; watch running: {watching}")
    return counts


run.TrainingRun._predictions = predictions_then_linger
recipe, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
