"""scripts/benchmark_precision.py and scripts/compare_runs.py on the tiny random BERT, on CPU."""

import json
import os
import sys

import pytest
import torch
from conftest import (
    GLUE_DIR,
    REPO,
    TINY_BERT,
    load_module,
    load_recipe,
    reset_accelerate,
    run,
    train,
)
from wandb_offline import offline_run

import amp_recipes.measure.engine

pytestmark = pytest.mark.heavy  # many processes: CI runs this file in a lane of its own (.ci/run)

SCRIPT = REPO / "scripts" / "benchmark_precision.py"
# Batch 256 peaks near 1.0-1.1 GiB RSS (the interpreter and libraries are ~0.6 of it), so the
# search crosses this budget between 256 and 512 wherever the baseline lands.
BUDGET_GB = 1.25


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    """fp32 and bf16 really differ on a CPU; fp16 there is accelerate's silent fp32."""
    tmp_path = tmp_path_factory.mktemp("bench")
    output_dir = tmp_path / "out"
    result = run(
        [
            sys.executable,
            SCRIPT,
            "--config_name",
            TINY_BERT,
            "--arms",
            "fp32,bf16,fp16",
            "--seq_len",
            64,
            "--batch_size",
            4,
            "--warmup_steps",
            1,
            "--timed_steps",
            3,
            "--memory_budget_gb",
            BUDGET_GB,
            "--search_start",
            256,
            "--search_granularity",
            256,  # 256 fits, 512 does not: no bisection here (tests/unit/test_measure.py bisects)
            "--search_max",
            4096,
            "--bench_id",
            "tiny-bench",
            "--output_dir",
            output_dir,
            "--report_to",
            "all",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((output_dir / "results.json").read_text()), output_dir, result.stdout, tmp_path


def test_every_arm_has_every_figure(benchmark):
    payload, output_dir, stdout, _ = benchmark
    assert list(payload["arms"]) == ["fp32", "bf16", "fp16"]
    for key in ("device_type", "cpu_model", "torch", "transformers", "accelerate", "tf32_matmul_allowed"):
        assert key in payload["hardware"]
    for arm, result in payload["arms"].items():
        assert result["fits"], result
        for key in (
            "peak_memory_bytes",
            "median_step_seconds",
            "min_step_seconds",
            "max_step_seconds",
            "samples_per_second",
            "tokens_per_second",
            "flops_per_step",
            "max_batch_size",
            "trials",
        ):
            assert key in result, (arm, key)
        assert set(result["memory_split_bytes"]) == {
            "weights",
            "gradients",
            "optimizer_state",
            "activations_and_other",
        }
        split = result["memory_split_bytes"]
        # AdamW: two fp32 moments per weight, plus one scalar step counter per parameter tensor.
        assert 2 * split["weights"] <= split["optimizer_state"] < 2 * split["weights"] + 4096
        assert len(result["losses"]) == len(result["step_seconds"]) == 3
        assert result["mfu"] is None  # no known peak for a CPU
    assert (output_dir / "results.png").stat().st_size > 0
    assert "| bf16 | bf16 |" in (output_dir / "results.md").read_text()
    assert "| fp16 | fp32 |" in stdout


def test_an_out_of_memory_error_anywhere_in_a_trial_means_does_not_fit(benchmark, monkeypatch, tmp_path):
    """Every arm and trial runs in the benchmark's process, accelerate's state reset between them
    (fp32, then bf16: accelerate refuses an Accelerator of another precision in a process that has
    one): called here, the fixture's losses again. CUDA's out-of-memory error, which a CPU never
    raises, is raised where a GPU would raise it, from the trials past batch 96: the search reads
    it as "does not fit" and brackets the edge, and the next trial runs. Raised before the first
    step (the model's build, prepare()), the timed arm does not fit either; any other error is the
    crash the benchmark reports, never "does not fit"."""
    fresh, *_ = benchmark
    script = load_module(SCRIPT)
    real_measure = script.measure

    def measure(config, arm, batch_size, warmup_steps, timed_steps):
        if batch_size > 96:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_measure(config, arm, batch_size, warmup_steps, timed_steps)

    monkeypatch.setattr(script, "measure", measure)
    flags = ["--config_name", TINY_BERT, "--arms", "fp32,bf16", "--seq_len", 64, "--batch_size", 4]
    flags += ["--warmup_steps", 1, "--timed_steps", 3, "--memory_budget_gb", 20, "--search_start", 32]
    flags += ["--search_granularity", 32, "--search_max", 512]
    try:
        payload = script.main([*map(str, flags), "--output_dir", str(tmp_path / "here")])
    finally:
        reset_accelerate()
    assert payload["complete"] and list(payload["arms"]) == ["fp32", "bf16"]
    for arm, result in payload["arms"].items():
        assert result["pid"] == os.getpid() and result["precision_in_effect"] == arm
        assert result["losses"] == pytest.approx(fresh["arms"][arm]["losses"], rel=1e-4), arm
        assert [t["batch_size"] for t in result["trials"]] == [32, 64, 128, 96]
        assert (result["max_batch_size"], result["first_batch_not_fitting"]) == (96, 128)
        assert [t["failure"] for t in result["trials"] if not t["fits"]] == ["out of memory"]

    def out_of_memory(config):  # the model's build
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(script, "measure", real_measure)
    monkeypatch.setattr(script, "build_model", out_of_memory)
    try:
        payload = script.main([*map(str, flags), "--output_dir", str(tmp_path / "build")])
    finally:
        reset_accelerate()
    arm = payload["arms"]["fp32"]
    assert (arm["fits"], arm["failure"], arm["max_batch_size"]) == (False, "out of memory", 0)

    def broken(config):
        raise RuntimeError("expected scalar type Half but found Float")

    monkeypatch.setattr(script, "build_model", broken)
    try:
        with pytest.raises(
            SystemExit, match="error: the fp32 arm crashed at batch 4: RuntimeError: expected"
        ):
            script.main([*map(str, flags), "--output_dir", str(tmp_path / "broken")])
    finally:
        reset_accelerate()


def test_headroom_search_finds_the_edge_of_the_budget(benchmark):
    payload, *_ = benchmark
    for arm, result in payload["arms"].items():
        trials = {trial["batch_size"]: trial for trial in result["trials"]}
        best = result["max_batch_size"]
        assert best >= 256 and trials[best]["fits"], (arm, result["trials"])
        assert trials[best]["peak_memory_bytes"] <= BUDGET_GB * 2**30
        next_step = result["first_batch_not_fitting"]
        assert next_step == best + 256, (arm, result["trials"])
        assert not trials[next_step]["fits"] and trials[next_step]["failure"] == "over the memory budget"
        assert trials[next_step]["peak_memory_bytes"] > BUDGET_GB * 2**30


def test_a_time_limit_skips_the_arms_it_leaves_no_time_for(monkeypatch):
    """--time_limit_s: no arm starts past it; the arms not yet timed are recorded as not run, and
    the table says so."""
    script = load_module(SCRIPT)
    tried = []

    def fake_trial(args, arm, batch_size, warmup_steps, timed_steps):
        tried.append((arm, batch_size))
        return {"arm": arm, "batch_size": batch_size, "flops_per_step": 1e9, "median_step_seconds": 0.1}

    monkeypatch.setattr(script, "trial", fake_trial)
    args = script.parse_args(["--arms", "fp32,bf16", "--no_search", "--time_limit_s", "1"])
    monkeypatch.setattr(script, "out_of_time", lambda *_: len(tried) >= 1)
    hardware = {"device_type": "cpu", "device_name": "cpu"}
    results = script.run_arms(args, hardware, torch.device("cpu"), 2**30)
    assert tried == [("fp32", 32)] and results["fp32"]["fits"]
    assert results["bf16"] == {"arm": "bf16", "batch_size": 32, "fits": False, "not_run": "time limit"}
    assert "| bf16 | — | not run: time limit |" in script.markdown_table({"bf16": results["bf16"]})


def test_a_cuda_error_ends_the_arms_after_it_in_one_sentence(monkeypatch):
    """An illegal memory access (or a device-side assert) leaves the process's CUDA context unusable:
    the arm that met it is recorded with its error, the arms after it as not run, saying why,
    instead of crashing one after the other; the arms before it keep their figures."""
    script = load_module(SCRIPT)
    tried = []

    def fake_trial(args, arm, batch_size, warmup_steps, timed_steps):
        tried.append(arm)
        if arm == "fp16":
            message = (
                "the fp16 arm crashed at batch 32: AcceleratorError: CUDA error: an illegal memory access"
            )
            raise script.BenchmarkCrash(message, fatal=True)
        return {"arm": arm, "batch_size": batch_size, "flops_per_step": 1e9, "median_step_seconds": 0.1}

    monkeypatch.setattr(script, "trial", fake_trial)
    args = script.parse_args(["--arms", "fp32,fp16,bf16", "--no_search"])
    results = script.run_arms(args, {"device_type": "cpu", "device_name": "cpu"}, torch.device("cpu"), 2**30)
    assert tried == ["fp32", "fp16"] and results["fp32"]["fits"]
    assert results["fp16"]["cuda_context_lost"] and "illegal memory access" in results["fp16"]["crashed"]
    assert results["bf16"]["not_run"] == (
        "the CUDA context is unusable after the fp16 arm's crash; run this arm on its own"
    )


def test_each_arms_search_gets_its_share_of_the_time_and_says_how_it_goes(monkeypatch, capsys):
    """--time_limit_s 100 over two arms whose trials all fit and take 10 s each (a clock of the
    script's own, moved by the trials): fp32 gets half the time (its timed steps, then a search of
    40 s), bf16 the other half; each search ends on a lower bound, and every trial prints the batch,
    whether it fit, and the search's time against its bound. Before, fp32's search took all of it
    and bf16 was not run."""
    script = load_module(SCRIPT)

    class Clock:
        now = 0.0

        def monotonic(self):
            return self.now

    clock = Clock()
    argv = ["--arms", "fp32,bf16", "--search_start", "8", "--time_limit_s", "100", "--memory_budget_gb", "4"]
    args = script.parse_args(argv)
    monkeypatch.setattr(script, "time", clock)
    monkeypatch.setattr(amp_recipes.measure.engine, "time", clock)  # the engine's search reads the same clock
    args.started = 0.0

    def fake_trial(args, arm, batch_size, warmup_steps, timed_steps):
        clock.now += 10
        args.longest_trial_s = 10.0
        timed = {"flops_per_step": 1e9, "median_step_seconds": 0.1, "precision_in_effect": arm}
        return {"arm": arm, "batch_size": batch_size, "peak_memory_bytes": 2**30, **timed}

    monkeypatch.setattr(script, "trial", fake_trial)
    hardware = {"device_type": "cpu", "device_name": "cpu"}
    results = script.run_arms(args, hardware, torch.device("cpu"), 4 * 2**30)
    searched = {arm: [trial["batch_size"] for trial in results[arm]["trials"]] for arm in results}
    assert searched == {"fp32": [8, 16, 32, 64], "bf16": [8, 16, 32, 64]}
    assert all(results[arm]["search_stopped"] == "out of time" for arm in results)
    assert (results["fp32"]["max_batch_size"], results["bf16"]["max_batch_size"]) == (64, 64)
    printed = capsys.readouterr().out
    assert "[fp32] batch 8: fits, peak 1.00 GiB (10.0 s; search 10 s of 40 s)" in printed
    assert "[bf16] batch 64: fits, peak 1.00 GiB (10.0 s; search 40 s of 40 s)" in printed


def test_without_a_budget_a_cpu_predicts_the_batch_as_the_doctor_does(tmp_path):
    """No --memory_budget_gb on a CPU: the largest batch is predicted from the peaks at --batch_size
    and twice it (two trials), within what is free; the table's note says how."""
    argv = [SCRIPT, "--config_name", TINY_BERT, "--arms", "fp32", "--seq_len", 32, "--batch_size", 4]
    result = run(
        [sys.executable, *argv, "--warmup_steps", 1, "--timed_steps", 2, "--output_dir", tmp_path], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    fp32 = json.loads((tmp_path / "results.json").read_text())["arms"]["fp32"]
    assert fp32["method"] == "predicted" and [t["batch_size"] for t in fp32["trials"]] == [4, 8]
    line = fp32["fixed_bytes"] + fp32["max_batch_size"] * fp32["bytes_per_row"]
    assert fp32["max_batch_size"] > 8 and line <= fp32["budget_bytes"] < line + fp32["bytes_per_row"]
    assert (
        "max batch predicted on this CPU, from the peaks at batch 4 and 8"
        in (tmp_path / "results.md").read_text()
    )


def test_a_gpus_budget_is_stated_under_the_table():
    """On CUDA the budget is the card's (or --memory_budget_gb's) less what lives outside PyTorch's
    allocator and the reserve: results.md says each figure (results.json has them)."""
    script = load_module(SCRIPT)
    arm = {"arm": "fp16", "fits": True, "precision_in_effect": "fp16", "peak_memory_bytes": 2**30}
    arm |= {"median_step_seconds": 0.1, "samples_per_second": 320.0, "max_batch_size": 512}
    arm |= {"budget_bytes": 80 * 2**30, "allocator_cap_bytes": 77 * 2**30}
    arm |= {"outside_allocator_bytes": 2 * 2**30, "reserve_bytes": 2**30}
    assert (
        "- fp16, max batch within 80.00 GiB: PyTorch's allocator capped at 77.00 GiB (2.00 GiB outside it: "
        "the CUDA context, other processes; 1.00 GiB kept free for what CUDA adds there)"
        in script.markdown_table({"fp16": arm})
    )


def test_fp16_on_cpu_is_not_reduced_precision_and_gets_no_ratio(benchmark):
    payload, *_ = benchmark
    fp16, bf16 = payload["arms"]["fp16"], payload["arms"]["bf16"]
    assert fp16["precision_in_effect"] == "fp32"
    assert fp16["ratios_vs_fp32"] is None
    assert fp16["no_ratio_reason"] == "requested fp16 but ran fp32"
    assert bf16["precision_in_effect"] == "bf16"
    assert set(bf16["ratios_vs_fp32"]) == {"memory_drop_percent", "speedup", "headroom"}
    # Same seed, same weights, same batches: bf16 tracks the fp32 loss closely but not exactly.
    assert 0 < bf16["loss_vs_fp32"]["max"] < 0.05


def test_wandb_has_one_run_per_arm_in_one_group_and_tensorboard_a_folder_per_arm(benchmark):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    payload, output_dir, _, _ = benchmark
    for arm, result in payload["arms"].items():
        accumulator = EventAccumulator(str(output_dir / "logs" / arm), size_guidance={"scalars": 0})
        accumulator.Reload()
        assert [point.value for point in accumulator.Scalars("loss")] == pytest.approx(result["losses"])
        assert accumulator.Scalars("peak_memory_bytes")[0].value == pytest.approx(result["peak_memory_bytes"])
    runs = sorted((output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 3
    job_types = set()
    for run_dir in runs:
        wandb_run, config, history = offline_run(run_dir.parent.parent, run_dir=run_dir)
        assert wandb_run.run_group == "tiny-bench"
        job_types.add(wandb_run.job_type)
        assert config["seq_len"] == 64
        assert len([row for row in history if "loss" in row]) == 3
    assert job_types == {"fp32", "bf16", "fp16"}


def test_compiled_arm_reports_compile_time_apart_from_step_time(tmp_path):
    """fp32+compile: the same arm under torch.compile with the recipes' settings (dynamo's eager
    backend here: the graphs without inductor's code generation)."""
    output_dir = tmp_path / "out"
    argv = [
        SCRIPT,
        "--config_name",
        TINY_BERT,
        "--arms",
        "fp32,fp32+compile",
        "--torch_compile_backend",
        "eager",
    ]
    argv += ["--seq_len", 32, "--batch_size", 4, "--warmup_steps", 1, "--timed_steps", 3, "--no_search"]
    result = run([sys.executable, *argv, "--output_dir", output_dir], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    arms = json.loads((output_dir / "results.json").read_text())["arms"]
    eager, compiled = arms["fp32"], arms["fp32+compile"]
    assert eager["compile_seconds"] is None and "compiled_graphs" not in eager
    assert compiled["compiled_graphs"] >= 2 and compiled["recompile_limit_hit"] is False
    assert compiled["compile_seconds"] > compiled["median_step_seconds"]  # tracing is not free
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)  # same model, same batches
    assert "speedup" in compiled["ratios_vs_fp32"]  # compared with eager fp32
    assert "| compile (s) |" in (output_dir / "results.md").read_text()


def test_gradient_checkpointing_arm_is_compared_with_the_same_arm_keeping_its_activations(tmp_path):
    """fp32+gradient_checkpointing: the recipes' --gradient_checkpointing in the benchmark. Same
    losses as fp32 (only the memory/compute trade changes), less peak memory, and its own ratios
    against the fp32 arm (what checkpointing alone buys) in results.json and results.md."""
    output_dir = tmp_path / "out"
    argv = [SCRIPT, "--config_name", TINY_BERT, "--arms", "fp32,fp32+gradient_checkpointing"]
    argv += ["--seq_len", 128, "--batch_size", 32, "--warmup_steps", 1, "--timed_steps", 2, "--no_search"]
    result = run([sys.executable, *argv, "--output_dir", output_dir], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    arms = json.loads((output_dir / "results.json").read_text())["arms"]
    kept, recomputed = arms["fp32"], arms["fp32+gradient_checkpointing"]
    assert (kept["gradient_checkpointing"], recomputed["gradient_checkpointing"]) == (False, True)
    assert recomputed["losses"] == pytest.approx(kept["losses"], rel=1e-6)
    assert recomputed["peak_memory_bytes"] < kept["peak_memory_bytes"]
    ratios = recomputed["ratios_vs_without_checkpointing"]
    # The speed ratio is reported, not asserted: two timed steps of a tiny model on a loaded CI
    # machine measured 1.14x once (the recompute's cost hidden in the noise).
    assert ratios["memory_drop_percent"] > 0 and ratios["speedup"] > 0
    assert (
        "- fp32+gradient_checkpointing against fp32 (gradient checkpointing alone): peak memory -"
        in (output_dir / "results.md").read_text()
    )


def test_bad_arm_is_refused(tmp_path):
    result = run(
        [sys.executable, SCRIPT, "--arms", "fp32,int8,fp16+jit,fp16+compile+gradient_checkpointing"], tmp_path
    )
    assert result.returncode == 2
    assert (
        "unknown arm(s) ['int8', 'fp16+jit', 'fp16+compile+gradient_checkpointing']; choose from fp32, tf32, "
        "fp16, bf16, fp8 (each may end in +gradient_checkpointing and/or +compile, in that order)."
        in result.stderr
    )


def test_a_crashed_trial_fails_the_benchmark_loudly(tmp_path):
    """A trial that crashes for another reason than memory is a failure, never "does not fit"."""
    missing = tmp_path / "no-such-model"
    argv = ["--model_name_or_path", missing, "--arms", "fp32", "--no_search", "--seq_len", 16]
    try:  # in this process, as test_an_out_of_memory_error_anywhere_in_a_trial_means_does_not_fit
        with pytest.raises(SystemExit, match="^error: the fp32 arm crashed at batch 32: OSError: "):
            load_module(SCRIPT).main([*map(str, argv), "--output_dir", str(tmp_path / "out")])
    finally:
        reset_accelerate()
    arm = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]["fp32"]
    assert arm["fits"] is False and "no-such-model" in arm["crashed"]
    assert (
        "| fp32 | — | crashed: the fp32 arm crashed at batch 32"
        in (tmp_path / "out" / "results.md").read_text()
    )


def test_a_crashing_arm_keeps_the_other_arms_figures(tmp_path):
    """A compiled arm that cannot compile (here: a backend that does not exist) is recorded with its
    error; the eager arm beside it keeps its figures."""
    command = [
        sys.executable,
        SCRIPT,
        "--config_name",
        TINY_BERT,
        "--arms",
        "fp32+compile,fp32",
        "--no_search",
    ]
    command += ["--torch_compile_backend", "no_such_backend", "--seq_len", 32, "--batch_size", 4]
    command += ["--warmup_steps", 1, "--timed_steps", 2]
    result = run([*command, "--output_dir", tmp_path / "out"], tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "error: the fp32+compile arm crashed at batch" in result.stderr
    arms = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]
    assert arms["fp32+compile"]["crashed"].endswith(
        "'NO_SUCH_BACKEND' is not a valid DynamoBackend"
    )  # its error line
    assert (
        arms["fp32"]["fits"] and arms["fp32"]["median_step_seconds"] > 0 and arms["fp32"]["peak_memory_bytes"]
    )
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| fp32+compile | — | crashed: the fp32+compile arm crashed" in table


def test_compare_runs_on_two_real_fine_tunes(tmp_path):
    common = [
        "--task_name",
        "mrpc",
        "--data_dir",
        GLUE_DIR,
        "--model_name_or_path",
        TINY_BERT,
        "--max_train_samples",
        32,
        "--max_eval_samples",
        32,
        "--per_device_train_batch_size",
        8,
        "--logging_steps",
        1,
        "--num_train_epochs",
        1,
    ]
    for name, precision in (("fp32", "no"), ("bf16", "bf16")):  # the fine-tunes in this process
        train(
            load_recipe("bert_glue"),
            [*common, "--mixed_precision", precision, "--output_dir", tmp_path / name],
        )
    result = run(
        [
            sys.executable,
            REPO / "scripts" / "compare_runs.py",
            tmp_path / "fp32",
            tmp_path / "bf16",
            "--output",
            tmp_path / "cmp",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "cmp.md").read_text()
    assert table == result.stdout.rstrip("\n") + "\n" or table.strip() in result.stdout
    rows = [line for line in table.splitlines() if line.startswith("| fp32") or line.startswith("| bf16")]
    assert rows[0].split(" | ")[1] == "fp32" and rows[1].split(" | ")[1] == "bf16"
    assert "eval_f1" in table and "1.00x" in rows[0] and "0.0%" in rows[0]
    assert (tmp_path / "cmp.png").stat().st_size > 0
    runs = json.loads((tmp_path / "cmp.json").read_text())["runs"]
    assert [run["results"]["precision_in_effect"] for run in runs] == ["fp32", "bf16"]
    assert runs[1]["path"] == str(tmp_path / "bf16") and any("loss" in row for row in runs[1]["history"])


def test_compare_runs_refuses_an_unfinished_run(tmp_path):
    (tmp_path / "a").mkdir()
    result = run(
        [sys.executable, REPO / "scripts" / "compare_runs.py", tmp_path / "a", tmp_path / "a"], tmp_path
    )
    assert result.returncode == 1
    assert "has no eval_results.json (not a finished bert_glue.py run)" in result.stderr


def test_real_glue_batches_under_accelerate_launch(tmp_path):
    from conftest import accelerate_launch

    result = run(
        accelerate_launch(
            "--num_processes",
            1,
            SCRIPT,
            "--config_name",
            TINY_BERT,
            "--tokenizer_name",
            TINY_BERT,
            "--task_name",
            "rte",
            "--data_dir",
            GLUE_DIR,
            "--arms",
            "fp32",
            "--seq_len",
            64,
            "--batch_size",
            4,
            "--warmup_steps",
            1,
            "--timed_steps",
            2,
            "--no_search",
            "--output_dir",
            tmp_path / "out",
        ),
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    fp32 = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]["fp32"]
    assert fp32["fits"] and fp32["tokens_per_second"] > 0
    assert "max_batch_size" not in fp32 and len(fp32["losses"]) == 2


@pytest.mark.parametrize(
    "head, auto_class", [("token", "BertForTokenClassification"), ("qa", "BertForQuestionAnswering")]
)
def test_each_head_trains_on_batches_of_its_shape(head, auto_class):
    """--head token / qa: the tagger of bert_ner.py, the span head of extractive QA; one step each
    on the synthetic batches gives a finite loss and gradients for the head."""
    benchmark = load_module(SCRIPT)
    config = {"head": head, "model_name_or_path": None, "config_name": str(TINY_BERT), "task_name": None}
    config["seq_len"] = 24
    torch.manual_seed(0)
    model = benchmark.build_model(config)
    assert type(model).__name__ == auto_class
    (batch,) = benchmark.make_batches(config, model.config, batch_size=3, count=1)
    if head == "token":
        assert batch["labels"].shape == (3, 24) and int(batch["labels"].max()) < 9
    else:
        assert (batch["start_positions"] <= batch["end_positions"]).all()
        assert (batch["end_positions"] < 24).all() and (
            batch["end_positions"] - batch["start_positions"] < 30
        ).all()
    loss = model(**batch).loss
    loss.backward()
    head_layer = model.classifier if head == "token" else model.qa_outputs
    assert torch.isfinite(loss) and head_layer.weight.grad.abs().sum() > 0


def test_the_qa_head_at_a_squad_length_under_the_benchmark(tmp_path, capsys):
    script = load_module(SCRIPT)
    argv = ["--config_name", TINY_BERT, "--head", "qa", "--arms", "fp32", "--seq_len", 384, "--batch_size", 2]
    argv += ["--warmup_steps", 1, "--timed_steps", 2, "--no_search", "--bench_id", "qa"]
    try:
        script.main([*map(str, argv), "--output_dir", str(tmp_path / "out")])
    finally:
        reset_accelerate()
    arm = json.loads((tmp_path / "out" / "results.json").read_text())["arms"]["fp32"]
    assert arm["head"] == "qa" and arm["seq_len"] == 384 and arm["tokens_per_second"] > 0
    assert "qa head, seq_len 384" in (tmp_path / "out" / "results.md").read_text()
    with pytest.raises(SystemExit) as refused:
        script.parse_args(["--task_name", "mrpc", "--head", "token"])
    assert refused.value.code == 2 and "--task_name times GLUE batches" in capsys.readouterr().err
