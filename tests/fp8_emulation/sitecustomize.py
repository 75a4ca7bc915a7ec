"""Test-only: torchao's fp8 training path on a CPU. Python runs this file at start-up in every
process whose PYTHONPATH holds this folder (`accelerate launch`'s workers, the benchmark's trials);
in-process tests use conftest's `fp8_on_cpu` fixture, which calls the same function.

It changes only what this CPU cannot do. The device check (fp8 needs compute capability 8.9; this
CPU passes it), and in the product's own Float8LinearConfig one field, through
`dataclasses.replace`: torchao's `emulate=True`, which rounds values to fp8 (e4m3 forward, e5m2
gradients) and scales them exactly as on a GPU, and runs the matmuls in high precision instead of on
fp8 Tensor Cores. Every other field is the product's (tests/unit/test_precision.py checks it), and
everything else (accelerate's conversion at prepare(), the layer report, checkpoints) is the
product's own code."""


def emulate_fp8(setattr=setattr):
    import dataclasses

    from amp_recipes.amp import precision

    product_config = precision.fp8_linear_config

    def emulated_config(*args, **kwargs):
        return dataclasses.replace(product_config(*args, **kwargs), emulate=True)

    setattr(precision, "fp8_refusal", lambda facts, backend: None)
    setattr(precision, "fp8_linear_config", emulated_config)


if __name__ == "sitecustomize":  # at start-up; not when the fixture loads this file under another name
    emulate_fp8()
