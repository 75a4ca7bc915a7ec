"""What the run reports as its precision, and who chose it."""

import os

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

from amp_recipes.amp import precision
from amp_recipes.amp.hardware import (
    device_facts,
    hardware_record,
    tf32_matmul_enabled,
    transparent_huge_pages,
)
from amp_recipes.amp.precision import (
    check_model_dtype,
    choose_auto_precision,
    describe_precision,
    effective_precision,
    format_preflight,
    fp8_backend_choice,
    fp8_recipe_kwargs,
    fp8_refusal,
    precision_source,
    preflight,
    preflight_checks,
    resolve_mixed_precision,
)
from amp_recipes.errors import InputError


@pytest.fixture
def fresh_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_fp16_on_cpu_is_reported_as_fp32(fresh_state, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    record = describe_precision(Accelerator(mixed_precision="fp16", cpu=True), "fp16")
    assert record["mixed_precision_requested"] == "fp16"
    assert record["precision_in_effect"] == "fp32"
    assert "accelerate runs fp32 on a cpu device" in record["precision_note"]


def test_bf16_on_cpu_uses_autocast(fresh_state, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    record = describe_precision(accelerator, "bf16")
    assert record["precision_in_effect"] == "bf16" and "precision_note" not in record
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    seen = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    accelerator.prepare(model)(torch.ones(2, 8))
    assert seen == [torch.bfloat16]  # autocast really is on (accelerate casts the output back to fp32)


def test_fp16_path_with_a_grad_scaler_is_fp16(fresh_state):
    # The CPU fp16 test fixture of the engineering guide: accelerate's real fp16 path.
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu")
    assert describe_precision(accelerator, None)["precision_in_effect"] == "fp16"


def test_precision_source(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert precision_source(None) == "default (no mixed precision)"
    assert precision_source("bf16") == "--mixed_precision flag"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert precision_source(None) == "accelerate launch / config file (ACCELERATE_MIXED_PRECISION)"
    assert (
        precision_source("bf16") == "--mixed_precision flag (bf16; overrides accelerate launch/config's fp16)"
    )


# ----------------------------------------------------------------------------- preflight and auto
H100 = {"device_type": "cuda", "device_name": "NVIDIA H100", "compute_capability": "9.0"}
H100.update(tensor_cores=True, bf16_supported=True)
V100 = {**H100, "device_name": "Tesla V100", "compute_capability": "7.0", "bf16_supported": False}
P100 = {**V100, "device_name": "Tesla P100", "compute_capability": "6.0", "tensor_cores": False}
CPU_BF16 = {"device_type": "cpu", "device_name": "Xeon 8480", "compute_capability": None}
CPU_BF16.update(tensor_cores=False, bf16_supported=True)
CPU_OLD = {**CPU_BF16, "device_name": "Xeon E5", "bf16_supported": False}


@pytest.mark.parametrize(
    "facts, choice, reason",
    [
        (H100, "bf16", "NVIDIA H100, compute capability 9.0 supports bf16"),
        (V100, "fp16", "Tesla V100, compute capability 7.0 has Tensor Cores but no native bf16"),
        (P100, "no", "Tesla P100, compute capability 6.0 predates Tensor Cores"),
        (CPU_BF16, "bf16", "this CPU (Xeon 8480) has native bf16"),
        (CPU_OLD, "no", "this CPU (Xeon E5) has no native bf16"),
        ({**CPU_OLD, "device_type": "mps", "device_name": "mps"}, "no", "no mixed-precision rule for a mps"),
    ],
)
def test_auto_precision_for_each_device(facts, choice, reason):
    chosen, why = choose_auto_precision(facts)
    assert chosen == choice and why.startswith(reason)


@pytest.mark.parametrize(
    "facts, requested, flag, launcher, expected",
    [
        (
            CPU_BF16,
            "fp16",
            "fp16",
            None,
            "fp16 was asked on a CPU, where accelerate silently runs fp32 (no autocast, no GradScaler); use --mixed_precision bf16 (this CPU has native bf16)",
        ),
        (
            CPU_OLD,
            "fp16",
            "fp16",
            None,
            "fp16 was asked on a CPU, where accelerate silently runs fp32 (no autocast, no GradScaler); use a CUDA GPU for fp16, or --mixed_precision no.",
        ),
        (
            CPU_OLD,
            "bf16",
            "bf16",
            None,
            "bf16 on Xeon E5, which has no native bf16 (AVX512-BF16/AMX): autocast emulates it and runs much slower than fp32",
        ),
        (
            P100,
            "fp16",
            None,
            "fp16",
            "fp16 on Tesla P100 (compute capability 6.0), which predates Tensor Cores (7.0): fp16 may be slower than fp32",
        ),
        (
            H100,
            "fp16",
            "fp16",
            "bf16",
            "--mixed_precision fp16 and the accelerate launch/config setting bf16 disagree: the script's flag wins, this run asks for fp16.",
        ),
    ],
)
def test_preflight_warnings(facts, requested, flag, launcher, expected):
    warnings, refusals = preflight_checks(facts, requested, flag, launcher)
    assert refusals == [] and len(warnings) == 1 and warnings[0].startswith(expected)


def test_preflight_refuses_bf16_on_a_gpu_without_it():
    warnings, refusals = preflight_checks(V100, "bf16", "bf16", None)
    assert warnings == []
    assert refusals == [
        "bf16 on Tesla V100 (compute capability 7.0): bf16 needs an Ampere (8.0) or newer GPU; "
        "use --mixed_precision fp16 (or auto)."
    ]


def test_preflight_is_quiet_when_all_is_well():
    assert preflight_checks(H100, "bf16", "bf16", "bf16") == ([], [])
    # `accelerate launch recipes/bert_glue.py --mixed_precision fp16` without a config: accelerate
    # exports its default "no", which the flag overrides without a disagreement.
    assert preflight_checks(H100, "fp16", "fp16", "no") == ([], [])
    assert preflight_checks(V100, "fp16", None, "fp16") == ([], [])
    assert preflight_checks(CPU_BF16, "fp16", "fp16", None, in_effect="fp16") == ([], [])  # the test fixture


def test_preflight_report_of_a_real_accelerator(fresh_state, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    report = preflight(Accelerator(mixed_precision="bf16", cpu=True), "bf16", facts=CPU_OLD)
    assert report["precision_in_effect"] == "bf16" and report["device_name"] == "Xeon E5"
    assert report["mixed_precision_source"].startswith("--mixed_precision flag (bf16; overrides")
    assert len(report["preflight_warnings"]) == 2  # the disagreement, and emulated bf16
    block = format_preflight(report)
    assert block.splitlines()[0] == "Preflight" and "bf16 in effect" in block
    with pytest.raises(InputError, match="bf16 needs an Ampere"):
        preflight(Accelerator(mixed_precision="bf16", cpu=True), "bf16", facts=V100)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_are_refused_under_amp(dtype):
    model = torch.nn.Linear(4, 4).to(dtype)
    with pytest.raises(
        InputError, match="weights are .* while fp16 mixed precision is on: load the model in float32"
    ):
        check_model_dtype(model, "fp16")
    check_model_dtype(torch.nn.Linear(4, 4), "fp16")  # fp32 master weights: fine
    check_model_dtype(model, "fp32")  # no AMP: the user's own choice
    with pytest.raises(InputError):
        check_model_dtype(model, "fp16", DistributedType.MULTI_GPU)
    # ZeRO-3's zero.Init builds half-precision module parameters; DeepSpeed's optimizer keeps
    # the fp32 master copy, so the run must not be refused.
    check_model_dtype(model, "fp16", DistributedType.DEEPSPEED)


CPU_16_CORES = {**CPU_BF16, "cpu_cores": 16}


@pytest.mark.parametrize(
    "threads, processes, warned",
    [(1, 1, True), (1, 4, True), (1, 16, False), (16, 1, False), (8, 2, False)],
)
def test_preflight_warns_when_a_cpu_run_is_pinned_to_one_thread(threads, processes, warned, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    facts = {**CPU_16_CORES, "torch_threads": threads}
    warnings, refusals = preflight_checks(facts, "no", "no", None, num_processes=processes)
    assert refusals == []
    expected = [
        "this run computes with 1 thread on a CPU with 16 cores (OMP_NUM_THREADS=1; a bare "
        "`accelerate launch` sets it to 1): use every core with `accelerate launch --config_file "
        "accelerate_configs/cpu.yaml ...` or plain `python recipes/...`."
    ]
    assert warnings == (expected if warned else [])


def test_cpu_facts_count_cores_and_threads():
    facts = device_facts(torch.device("cpu"))
    assert facts["cpu_cores"] == len(os.sched_getaffinity(0))
    assert facts["torch_threads"] == torch.get_num_threads()


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags (through the new API) after a test that sets them."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    yield matmul
    matmul.fp32_precision = saved


def test_tf32_set_through_the_new_api_is_read_without_error(tf32_flags):
    tf32_flags.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        _ = tf32_flags.allow_tf32  # what hardware.py read before: it raises after the new API was used
    assert tf32_matmul_enabled() is True
    assert hardware_record(torch.device("cpu"))["tf32_matmul_allowed"] is True
    tf32_flags.fp32_precision = "ieee"
    assert tf32_matmul_enabled() is False


def test_fp32_with_tf32_matmuls_on_an_ampere_gpu_is_reported_as_tf32(tf32_flags, monkeypatch):
    """accelerate turns TF32 on for a compiled fp32 run on CUDA: the run must not claim fp32."""

    class CudaRun:  # the attributes effective_precision reads, on a faked CUDA device
        mixed_precision, device = "no", torch.device("cuda", 0)
        distributed_type = DistributedType.NO

    capability = {"major": 9}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (capability["major"], 0))
    tf32_flags.allow_tf32 = True  # the legacy setter, as accelerate's state.py does it
    assert effective_precision(CudaRun()) == "tf32"
    capability["major"] = 7  # Volta has no TF32
    assert effective_precision(CudaRun()) == "fp32"
    tf32_flags.fp32_precision = "ieee"
    capability["major"] = 9
    assert effective_precision(CudaRun()) == "fp32"


# ----------------------------------------------------------------------------- fp8
A100 = {**H100, "device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
T4 = {**V100, "device_name": "Tesla T4", "compute_capability": "7.5"}
L4 = {**H100, "device_name": "NVIDIA L4", "compute_capability": "8.9"}
NEEDS = "but fp8 training needs an NVIDIA GPU of compute capability 8.9 or newer (Ada L4/L40S, Hopper H100/H200, Blackwell)"


@pytest.mark.parametrize(
    "facts, expected",
    [
        (
            A100,
            f"fp8 was asked on NVIDIA A100-SXM4-80GB (compute capability 8.0), {NEEDS}; use --mixed_precision bf16 instead.",
        ),
        (
            T4,
            f"fp8 was asked on Tesla T4 (compute capability 7.5), {NEEDS}; use --mixed_precision fp16 instead.",
        ),
        (CPU_BF16, f"fp8 was asked on a cpu (Xeon 8480), {NEEDS}; use --mixed_precision bf16 instead."),
        (CPU_OLD, f"fp8 was asked on a cpu (Xeon E5), {NEEDS}; use --mixed_precision no instead."),
    ],
)
def test_fp8_is_refused_below_compute_capability_8_9_in_one_sentence(facts, expected, monkeypatch):
    monkeypatch.setattr(precision, "is_torchao_available", lambda: True)
    assert fp8_refusal(facts, "ao") == expected
    assert fp8_refusal(facts, "te") == expected  # the device first, whichever backend


def test_fp8_runs_from_compute_capability_8_9_with_its_backend_installed(monkeypatch):
    monkeypatch.setattr(precision, "is_torchao_available", lambda: True)
    monkeypatch.setattr(precision, "is_transformer_engine_available", lambda: True)
    for facts in (L4, H100, {**H100, "device_name": "NVIDIA B200", "compute_capability": "10.0"}):
        assert fp8_refusal(facts, "ao") is None and fp8_refusal(facts, "te") is None


def test_fp8_without_its_backend_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(precision, "is_torchao_available", lambda: False)
    monkeypatch.setattr(precision, "is_transformer_engine_available", lambda: False)
    assert fp8_refusal(H100, "ao") == (
        "fp8 with --fp8_backend ao needs torchao, which is not installed: `pip install -e '.[fp8]'` "
        "(or use --mixed_precision bf16 on this NVIDIA H100)."
    )
    assert fp8_refusal(L4, "te") == (
        "fp8 with --fp8_backend te needs transformer_engine, which is not installed: "
        "`pip install 'transformer-engine[pytorch]'` (or use --mixed_precision bf16 on this NVIDIA L4)."
    )


@pytest.mark.parametrize("facts", [H100, L4])
def test_auto_never_picks_fp8(facts, monkeypatch):
    monkeypatch.setattr(precision, "device_facts", lambda device=None: facts)
    assert resolve_mixed_precision("auto")[0] == "bf16"


def test_fp8_backend_comes_from_the_flag_then_accelerate_launch_then_torchao(monkeypatch):
    monkeypatch.delenv("ACCELERATE_FP8_BACKEND", raising=False)
    assert fp8_backend_choice(None) == "ao"
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")  # accelerate launch --fp8_backend te
    assert fp8_backend_choice(None) == "te" and fp8_backend_choice("ao") == "ao"
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "msamp")
    with pytest.raises(InputError, match="fp8 backend 'msamp' .* use --fp8_backend ao .* or te"):
        fp8_backend_choice(None)


def test_fp8_recipe_kwargs_refuse_before_any_accelerator_and_stay_empty_otherwise(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(precision, "device_facts", lambda device=None: A100)
    assert fp8_recipe_kwargs(None, None) == [] and fp8_recipe_kwargs("bf16", "te") == []
    with pytest.raises(
        InputError, match=r"^fp8 was asked on NVIDIA A100-SXM4-80GB \(compute capability 8\.0\)"
    ):
        fp8_recipe_kwargs("fp8", None)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")  # accelerate launch --mixed_precision fp8
    with pytest.raises(InputError, match="use --mixed_precision bf16 instead"):
        fp8_recipe_kwargs(None, None)
    assert fp8_recipe_kwargs("bf16", None) == []  # the flag wins over the launcher


def test_the_kernels_huge_page_mode_is_the_bracketed_word(tmp_path):
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")  # what Linux writes: the mode in effect bracketed
    assert transparent_huge_pages(str(enabled)) == "madvise"
    enabled.write_text("[always] madvise never\n")
    assert transparent_huge_pages(str(enabled)) == "always"
    assert transparent_huge_pages(str(tmp_path / "missing")) is None  # no THP in the kernel, or not Linux


def test_gradient_checkpointing_refuses_a_model_of_your_own_in_one_sentence():
    from amp_recipes.amp.memory import enable_gradient_checkpointing, gradient_checkpointing_on
    from amp_recipes.errors import InputError

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert gradient_checkpointing_on(model) is False
    with pytest.raises(InputError, match=r"Sequential is a model of your own: wrap its layers"):
        enable_gradient_checkpointing(model)
