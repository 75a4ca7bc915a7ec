"""Test helper: a rank dies or fails while another waits for it in a collective that never ends,
as NCCL's do (a CPU's gloo collective fails at once instead, and the waiting rank says why).

    BLOCK_RANK=0 BLOCK_STEP=4 PEER_RANK=1 PEER_END=sigkill [BLOCK_REPORT=file] accelerate launch ... \
        tests/recipes/blocked_in_a_collective.py recipes/bert_glue.py ...

At its training forward number BLOCK_STEP, rank BLOCK_RANK's main thread waits forever on a lock,
as a main thread waits in CUDA for a collective whose peer is gone: signals are noted and the wait
goes on. At the same forward, rank PEER_RANK ends: `sigkill` kills itself (out of memory, killed),
`error` raises an error of its own (a traceback), having written the time to BLOCK_REPORT. What
prepare() returns is otherwise the recipe's own, run as it is."""

import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

import accelerate

BLOCK_RANK, PEER_RANK = int(os.environ["BLOCK_RANK"]), int(os.environ["PEER_RANK"])
STEP, PEER_END = int(os.environ["BLOCK_STEP"]), os.environ["PEER_END"]
real_prepare = accelerate.Accelerator.prepare


def prepare_then_block(self, *args, **kwargs):
    prepared = real_prepare(self, *args, **kwargs)
    model = prepared[0]
    forward, calls = model.forward, []

    def forward_or_block(*inputs, **named):
        if model.training:
            calls.append(None)
            if len(calls) == STEP and self.process_index == BLOCK_RANK:
                threading.Event().wait()  # never set: a collective whose peer is gone
            if len(calls) == STEP and self.process_index == PEER_RANK:
                if os.environ.get("BLOCK_REPORT"):  # when it ended, for the test to time the launch's end
                    Path(os.environ["BLOCK_REPORT"]).write_text(repr(time.time()))
                if PEER_END == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise MemoryError("the peer's own error (tests/recipes/blocked_in_a_collective.py)")
        return forward(*inputs, **named)

    model.forward = forward_or_block
    return prepared


accelerate.Accelerator.prepare = prepare_then_block
recipe, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(recipe, run_name="__main__")
