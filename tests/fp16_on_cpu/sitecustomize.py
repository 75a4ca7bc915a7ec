"""Test-only: accelerate's real fp16 path (autocast, GradScaler, skipped steps) in every process of a
launch on a CPU. Python runs this file at start-up in every process whose PYTHONPATH holds this
folder; in-process tests use conftest's Fp16OnCpu, which does the same in one process.

accelerate turns fp16 on only off the CPU (Accelerator.__init__: `mixed_precision == "fp16" and
self.device.type != "cpu"`); torch itself runs fp16 autocast and a GradScaler on a CPU. After the
original __init__ this seam does what that branch would have done, with the CPU as the device:
native_amp on, and the GradScaler accelerate picks (FSDP2: get_fsdp2_grad_scaler; otherwise torch's
GradScaler) made with the run's own GradScalerKwargs (the recipes' --fp16_* flags). Nothing else
changes: prepare() wraps the forward in autocast and the optimizer in the scaler as on a GPU."""


def fp16_on_cpu(setattr=setattr):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    original = Accelerator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        engine_owned = self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        if self.state.mixed_precision != "fp16" or self.device.type != "cpu" or engine_owned:
            return
        self.native_amp = True
        settings = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
        if self.is_fsdp2:
            self.scaler = get_fsdp2_grad_scaler(device="cpu", **settings)
        else:
            self.scaler = torch.amp.GradScaler("cpu", **settings)

    setattr(Accelerator, "__init__", init)


if __name__ == "sitecustomize":  # at start-up; the next sitecustomize on the path runs after it
    import importlib.util
    from pathlib import Path

    fp16_on_cpu()
    chain = Path(__file__).resolve().parents[1] / "cpu_engines" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("cpu_engines_chain", chain)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.run_the_next_sitecustomize(Path(__file__).resolve().parent)
