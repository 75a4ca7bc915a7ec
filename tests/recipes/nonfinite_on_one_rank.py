"""Test helper: run a recipe whose training loss turns NaN on one rank only, at one optimizer step.

    NONFINITE_RANK=1 NONFINITE_STEP=3 accelerate launch ... tests/recipes/nonfinite_on_one_rank.py \
        recipes/bert_glue.py --checkpointing_steps 1 ...

What prepare() returns is wrapped after the fact: the model's forward (DDP's, FSDP2's, DeepSpeed's
engine's) runs as it is, and on that rank, at that training forward, its loss is multiplied by NaN.
Each rank writes how it ended (its one-sentence error, or its exit code, or "finished") to
NONFINITE_REPORT_DIR/rank-<R>.txt: a launch prints a sentence every rank reaches once
(amp_recipes.errors.first_to_say), so the output alone cannot say which ranks reached it."""

import os
import runpy
import sys
from pathlib import Path

import accelerate

from amp_recipes import errors

RANK, STEP = int(os.environ["NONFINITE_RANK"]), int(os.environ["NONFINITE_STEP"])
real_prepare = accelerate.Accelerator.prepare


def prepare_then_spoil(self, *args, **kwargs):
    prepared = real_prepare(self, *args, **kwargs)
    model = prepared[0]
    forward, calls = model.forward, []

    def forward_with_nan(*inputs, **named):
        outputs = forward(*inputs, **named)
        if model.training:
            calls.append(None)
            if self.process_index == RANK and len(calls) == STEP:
                outputs.loss = outputs.loss * float("nan")
        return outputs

    model.forward = forward_with_nan
    return prepared


accelerate.Accelerator.prepare = prepare_then_spoil
recipe, sys.argv = sys.argv[1], sys.argv[1:]
report = Path(os.environ["NONFINITE_REPORT_DIR"]) / f"rank-{os.environ['RANK']}.txt"
real_exit_with = errors.exit_with


def exit_with_reported(sentence):
    report.write_text(sentence)  # whether this rank prints it or another rank already did
    real_exit_with(sentence)


errors.exit_with = exit_with_reported
try:
    runpy.run_path(recipe, run_name="__main__")
except SystemExit as stop:
    if not report.exists():
        report.write_text(str(stop.code))
    raise
report.write_text("finished")
