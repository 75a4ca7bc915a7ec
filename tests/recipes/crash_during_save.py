"""Test helper: run recipes/bert_glue.py, but `kill -9` the process in the middle of writing its
second checkpoint (after accelerate has written the state files, before our marker and rename).

    python tests/recipes/crash_during_save.py recipes/bert_glue.py --checkpointing_steps 2 ...
"""

import os
import runpy
import signal
import sys

import accelerate

real_save_state = accelerate.Accelerator.save_state
calls = 0


def save_state_then_die(self, *args, **kwargs):
    global calls
    calls += 1
    result = real_save_state(self, *args, **kwargs)
    if calls == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return result


accelerate.Accelerator.save_state = save_state_then_die
recipe, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
