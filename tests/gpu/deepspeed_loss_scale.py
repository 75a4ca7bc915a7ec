"""Test helper: run a recipe under DeepSpeed and record its engine's loss scale after every step.

    LOSS_SCALE_REPORT=<file> OVERFLOW_STEPS=2,5 accelerate launch \
        --config_file accelerate_configs/deepspeed_zero2.yaml tests/gpu/deepspeed_loss_scale.py \
        recipes/bert_glue.py --mixed_precision fp16 --fp16_init_scale 1024 ...

What prepare() returns is watched after the fact: the DeepSpeed engine's forward and step run as
they are; at the training forwards named by OVERFLOW_STEPS the loss is multiplied by inf (an fp16
overflow DeepSpeed's scaler must skip), and after each engine.step() the scale DeepSpeed's own
loss scaler holds (engine.optimizer.loss_scale) is appended to LOSS_SCALE_REPORT (main process)."""

import json
import os
import runpy
import sys
from pathlib import Path

import accelerate
from deepspeed import DeepSpeedEngine

OVERFLOW_STEPS = {int(step) for step in os.environ.get("OVERFLOW_STEPS", "").split(",") if step}
REPORT = Path(os.environ["LOSS_SCALE_REPORT"])
real_prepare = accelerate.Accelerator.prepare


def prepare_then_watch(self, *args, **kwargs):
    prepared = real_prepare(self, *args, **kwargs)
    engine = prepared[0] if isinstance(prepared, tuple) else prepared
    if not isinstance(engine, DeepSpeedEngine):
        return prepared
    forward, step, forwards, scales = engine.forward, engine.step, [], []

    def forward_with_overflow(*inputs, **named):
        outputs = forward(*inputs, **named)
        if engine.training:
            forwards.append(None)
            if len(forwards) in OVERFLOW_STEPS:
                outputs.loss = outputs.loss * float("inf")
        return outputs

    def step_and_record(*step_args, **step_kwargs):
        step(*step_args, **step_kwargs)
        scales.append(float(engine.optimizer.loss_scale))
        if self.is_main_process:
            REPORT.write_text(json.dumps(scales))

    engine.forward, engine.step = forward_with_overflow, step_and_record
    return prepared


accelerate.Accelerator.prepare = prepare_then_watch
recipe, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
