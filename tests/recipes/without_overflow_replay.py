"""Test helper: run a recipe with the overflow replay turned off.

    accelerate launch ... tests/recipes/without_overflow_replay.py recipes/bert_glue.py ...

After a skipped fp16 step the recipe replays the batch to name the first module whose output or
gradient overflowed (amp_recipes.training.telemetry.locate_nonfinite). Here that replay is not made, and the
warning says so: the run a replayed run must equal, weight for weight, since the replay may only
look and must leave nothing behind."""

import runpy
import sys

from amp_recipes.training import telemetry


def not_replayed(accelerator, model, batch, loss_scale):
    return "not replayed (tests/recipes/without_overflow_replay.py)"


telemetry.locate_nonfinite = not_replayed
recipe, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
