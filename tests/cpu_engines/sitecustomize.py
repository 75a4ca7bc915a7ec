"""Test-only: accelerate's FSDP2 and DeepSpeed on a CPU process group (gloo). Python runs this file
at start-up in every process whose PYTHONPATH holds this folder (conftest.engine_env).

accelerate turns FSDP on only over a GPU or other accelerator process group (AcceleratorState's
`elif self.distributed_type in [MULTI_GPU, MULTI_NPU, ...]`: MULTI_CPU is not listed), and
DeepSpeed only when not asked for the CPU (`elif ACCELERATE_USE_DEEPSPEED ... and not cpu`). The
engines themselves run on CPU processes: torch's fully_shard over gloo, DeepSpeed's CPU accelerator
(DS_ACCELERATOR=cpu). Around the one call of AcceleratorState.__init__ this seam makes those two
conditions pass, and changes nothing else: the process group, the device, the backend and every
other setting are accelerate's own (tests/recipes/test_engines.py compares accelerate's whole state
with and without it)."""

import os
from pathlib import Path


def lift_gpu_gates(setattr=setattr):
    import inspect

    from accelerate import state
    from accelerate.utils import DistributedType, parse_flag_from_env

    original = state.AcceleratorState.__init__
    signature = inspect.signature(original)

    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        partial = state.PartialState._shared_state
        if not partial:  # what the original does first, so that the gate below sees the process group
            cpu = bound.arguments.get("cpu", False) or parse_flag_from_env("ACCELERATE_USE_CPU")
            state.PartialState(cpu, **bound.arguments.get("kwargs", {}))
        cpu_group = partial.get("distributed_type") == DistributedType.MULTI_CPU
        fsdp = parse_flag_from_env("ACCELERATE_USE_FSDP")
        deepspeed = parse_flag_from_env("ACCELERATE_USE_DEEPSPEED")
        use_cpu = os.environ.pop("ACCELERATE_USE_CPU", None) if cpu_group and deepspeed else None
        if cpu_group and fsdp:
            partial["distributed_type"] = DistributedType.MULTI_GPU
        if cpu_group and deepspeed:
            bound.arguments["cpu"] = False
        try:
            original(*bound.args, **bound.kwargs)
        finally:
            if use_cpu is not None:
                os.environ["ACCELERATE_USE_CPU"] = use_cpu
            if cpu_group and partial.get("distributed_type") == DistributedType.MULTI_GPU:
                partial["distributed_type"] = DistributedType.MULTI_CPU

    setattr(state.AcceleratorState, "__init__", init)


def run_the_next_sitecustomize(here: Path | None = None) -> None:
    """Python imports only the first sitecustomize on its path: the next one after `here` (this
    folder) on the path runs from here (the fp8 emulation's, for an FSDP2 + fp8 run)."""
    import importlib.util
    import sys

    here = here.resolve() if here else Path(__file__).resolve().parent
    folders = [Path(folder or ".").resolve() for folder in sys.path]
    after = folders[folders.index(here) + 1 :] if here in folders else folders
    for folder in after:
        candidate = folder / "sitecustomize.py"
        if folder != here and candidate.is_file():
            spec = importlib.util.spec_from_file_location("sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


if __name__ == "sitecustomize":
    lift_gpu_gates()
    run_the_next_sitecustomize()
