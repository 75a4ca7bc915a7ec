"""Test-only: torchao's fp8 training path on a CPU. Python runs this file at start-up in every
process whose PYTHONPATH holds this folder (`accelerate launch`'s workers, the benchmark's trials);
in-process tests use conftest's `fp8_on_cpu` fixture, which calls the same function.

Two seams of amp_recipes.precision are replaced: the device check (fp8 needs compute capability
8.9; this CPU passes), and the Float8Linear settings, with torchao's `emulate=True`: values are
rounded to fp8 (e4m3 forward, e5m2 gradients) and scaled exactly as on a GPU, and the matmuls run
in high precision instead of on fp8 Tensor Cores. Everything else (accelerate's conversion at
prepare(), the layer report, checkpoints) is the product's own code."""


def emulate_fp8(setattr=setattr):
    from torchao.float8 import Float8LinearConfig

    from amp_recipes import precision

    setattr(precision, "fp8_refusal", lambda facts, backend: None)
    setattr(precision, "fp8_linear_config", lambda: Float8LinearConfig(pad_inner_dim=True, emulate=True))


if __name__ == "sitecustomize":  # at start-up; not when the fixture loads this file under another name
    emulate_fp8()
