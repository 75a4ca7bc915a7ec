"""scripts/paired_runs.py: arms x seeds as real `accelerate launch` runs of a recipe, and the
comparison (paired confidence intervals, verdicts) written from their eval_results.json."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY_BERT, glue_flags, load_module, run
from wandb_offline import offline_run, offline_summary

from amp_recipes.measure import report

SCRIPT = REPO / "scripts" / "paired_runs.py"
paired = load_module(SCRIPT, "paired_runs")


# ----------------------------------------------------------------------------- statistics
def test_paired_interval_on_a_hand_worked_example():
    # differences 1, 2, 3: mean 2, sd 1, standard error 1/sqrt(3); t(0.975, df=2) = 4.302653
    interval = paired.paired_interval([1.0, 2.0, 3.0])
    assert interval["mean"] == pytest.approx(2.0) and interval["sd"] == pytest.approx(1.0)
    assert interval["half_width"] == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)
    assert interval["ci"] == pytest.approx([2 - 2.484138, 2 + 2.484138], rel=1e-6)
    assert paired.verdict("bf16", interval) == "within seed noise"
    # 2.0, 2.2, 1.8, 2.0: sd sqrt(0.08 / 3) = 0.163299; t(0.975, df=3) = 3.182446 -> 2.0 +- 0.259846
    interval = paired.paired_interval([2.0, 2.2, 1.8, 2.0])
    assert interval["half_width"] == pytest.approx(3.182446 * 0.163299 / 2, rel=1e-5)
    assert paired.verdict("bf16", interval) == "bf16 higher by 2 ± 0.2598"
    assert paired.verdict("fp16", paired.paired_interval([-0.5, -0.7, -0.6])) == "fp16 lower by 0.6 ± 0.2484"
    one = paired.paired_interval([0.3])
    assert math.isnan(one["half_width"]) and paired.verdict("fp16", one).startswith("one seed: no verdict")
    assert paired.verdict("fp16", paired.paired_interval([])).startswith("no seed with both arms finished")
    assert report.json_safe({"sd": math.nan, "values": [0.3, math.nan]}) == {
        "sd": None,
        "values": [0.3, None],
    }


def write_run(folder: Path, **results):
    folder.mkdir(parents=True)
    (folder / "eval_results.json").write_text(json.dumps(results))


def fake_args(arms, seeds):
    return paired.argparse.Namespace(
        arms=arms, seeds=seeds, group="g", recipe_name="bert_glue", recipe_args=["--task_name", "mrpc"]
    )


def figures(f1, speed, memory, precision, sha="same"):
    return {
        "eval_f1": f1,
        "eval_samples": 408,
        "eval_samples_mm": 408,
        "train_runtime_seconds": 100 / speed,
        "train_samples_per_second": speed,
        "peak_memory_bytes": memory,
        "precision_in_effect": precision,
        "initial_weights_sha256": sha,
    }


def test_aggregates_are_the_runs_own_figures_and_fp16_on_cpu_gets_no_verdict(tmp_path):
    runs = []
    table = {  # seed -> (fp32 f1, bf16 f1)
        1: (0.80, 0.81),
        2: (0.82, 0.80),
        3: (0.84, 0.85),
    }
    for seed, (f1_fp32, f1_bf16) in table.items():
        for arm, f1, speed, memory, ran in (
            ("fp32", f1_fp32, 10.0, 4e9, "fp32"),
            ("bf16", f1_bf16, 10.0 * (1 + seed / 10), 3e9, "bf16"),
            ("fp16", f1_fp32, 10.0, 4e9, "fp32"),  # fp16 asked on a CPU: accelerate ran fp32
        ):
            folder = tmp_path / f"{arm}-seed{seed}"
            write_run(folder, **figures(f1, speed, memory, ran, sha=f"init-{seed}"))
            runs.append({"arm": arm, "seed": seed, "run_dir": str(folder), "status": "finished"})
    comparison = paired.compare(fake_args(["fp32", "bf16", "fp16"], [1, 2, 3]), runs)
    assert comparison["metrics"] == ["eval_f1"]  # eval_samples is a count, not a score
    bf16 = comparison["per_arm"]["bf16"]
    assert bf16["eval_f1"]["values"] == [0.81, 0.80, 0.85]
    assert bf16["eval_f1"]["mean"] == pytest.approx(0.82)
    assert bf16["train_samples_per_second"]["values"] == pytest.approx([11.0, 12.0, 13.0])
    versus = comparison["vs_fp32"]["bf16"]
    assert versus["speedup"]["values"] == pytest.approx([1.1, 1.2, 1.3])
    assert versus["memory_drop_percent"]["values"] == pytest.approx([25.0, 25.0, 25.0])
    f1 = versus["metrics"]["eval_f1"]
    assert f1["values"] == pytest.approx([0.01, -0.02, 0.01]) and f1["verdict"] == "within seed noise"
    assert "ran fp32" in comparison["vs_fp32"]["fp16"]["no_ratio_reason"]
    assert "metrics" not in comparison["vs_fp32"]["fp16"]
    text = paired.markdown(comparison, None)
    assert "| bf16 | bf16 | 3 | 0.82 ± 0.026 |" in text
    assert "speedup 1.2 ± 0.1x, peak-memory drop 25 ± 0%" in text
    assert "**fp16 vs fp32**: requested fp16 but ran fp32" in text
    paired.plot(comparison, tmp_path / "comparison.png")
    assert (tmp_path / "comparison.png").stat().st_size > 10_000


def test_an_emulated_fp8_arm_gets_a_verdict_but_no_speed_or_memory(tmp_path):
    """torchao's emulation rounds to fp8 as the GPU would, in fp32 matmuls: its scores say what fp8
    numerics do to accuracy; its time and memory say nothing about fp8 hardware."""
    runs = []
    for seed, (f1_fp32, f1_fp8) in {1: (0.80, 0.79), 2: (0.82, 0.808), 3: (0.84, 0.829)}.items():
        for arm, f1, speed in (("fp32", f1_fp32, 10.0), ("fp8", f1_fp8, 2.0)):
            folder = tmp_path / f"{arm}-seed{seed}"
            write_run(
                folder, **figures(f1, speed, 4e9, arm if arm == "fp8" else "fp32"), fp8_emulated=arm == "fp8"
            )
            runs.append({"arm": arm, "seed": seed, "run_dir": str(folder), "status": "finished"})
    comparison = paired.compare(fake_args(["fp32", "fp8"], [1, 2, 3]), runs)
    fp8 = comparison["per_arm"]["fp8"]
    assert fp8["fp8_emulated"] and fp8["train_samples_per_second"]["n"] == fp8["peak_memory_bytes"]["n"] == 0
    versus = comparison["vs_fp32"]["fp8"]
    assert versus["speedup"]["n"] == versus["memory_drop_percent"]["n"] == 0
    f1 = versus["metrics"]["eval_f1"]
    assert f1["values"] == pytest.approx([-0.01, -0.012, -0.011])
    assert f1["verdict"] == "fp8 lower by 0.011 ± 0.002484"  # t(0.975, 2) = 4.303 x sd 0.001 / sqrt(3)
    text = paired.markdown(comparison, None)
    [row] = [line for line in text.splitlines() if line.startswith("| fp8 |")]
    assert row.startswith("| fp8 | fp8 (emulated) | 3 | 0.809 ± ") and row.endswith("| — | — | — |")
    assert (
        "**fp8 vs fp32** (paired by seed, 3 seed(s)): fp8 was emulated (fp8 rounding, matmuls in high precision): no speed or memory ratio."
        in text
    )
    paired.plot(comparison, tmp_path / "comparison.png")


def test_a_gradient_checkpointing_arm_is_compared_with_fp32_and_with_the_arm_keeping_activations(tmp_path):
    """bf16+gradient_checkpointing: the bf16 arm again with the recipe's --gradient_checkpointing.
    Against fp32 like any arm (what both levers buy), and against bf16 (what checkpointing alone
    buys: less memory, a slower step), paired by seed, in comparison.json, the report and W&B's summary."""
    runs = []
    for seed in (1, 2, 3):
        for arm, speed, memory, ran in (
            ("fp32", 10.0, 4e9, "fp32"),
            ("bf16", 12.0, 3e9, "bf16"),
            ("bf16+gradient_checkpointing", 9.0 + seed / 10, 2e9, "bf16"),
        ):
            folder = tmp_path / f"{arm}-seed{seed}"
            write_run(folder, **figures(0.8, speed, memory, ran, sha=f"init-{seed}"))
            runs.append({"arm": arm, "seed": seed, "run_dir": str(folder), "status": "finished"})
    arms = ["fp32", "bf16", "bf16+gradient_checkpointing"]
    comparison = paired.compare(fake_args(arms, [1, 2, 3]), runs)
    both = comparison["vs_fp32"]["bf16+gradient_checkpointing"]
    assert both["memory_drop_percent"]["values"] == pytest.approx([50.0, 50.0, 50.0])
    alone = comparison["vs_without_checkpointing"]["bf16+gradient_checkpointing"]
    assert alone["against"] == "bf16" and alone["seeds"] == [1, 2, 3]
    assert alone["memory_drop_percent"]["values"] == pytest.approx([100 / 3] * 3)
    assert alone["speedup"]["values"] == pytest.approx([9.1 / 12, 9.2 / 12, 9.3 / 12])
    assert list(comparison["vs_without_checkpointing"]) == ["bf16+gradient_checkpointing"]
    text = paired.markdown(comparison, None)
    assert (
        "**bf16+gradient_checkpointing vs bf16** (gradient checkpointing alone, paired by seed, 3 seed(s)): "
        "speedup 0.767 ± 0.0083x, peak-memory drop 33.3 ± 0%." in text
    )
    summary = paired.comparison_summary(comparison)
    assert summary["bf16+gradient_checkpointing/vs_bf16/memory_drop_percent"] == pytest.approx(100 / 3)
    assert summary["bf16+gradient_checkpointing/memory_drop_percent"] == pytest.approx(50.0)


def test_an_arms_modifier_passes_its_flag_to_its_runs_only(tmp_path):
    args = parse("--arms", "fp32,fp32+gradient_checkpointing", "--output_dir", str(tmp_path / "pair"))
    assert args.arms == ["fp32", "fp32+gradient_checkpointing"]
    plain = paired.launch_command(args, "fp32", 1, tmp_path / "a")
    checkpointed = paired.launch_command(args, "fp32+gradient_checkpointing", 1, tmp_path / "b")
    assert "--gradient_checkpointing" not in plain and checkpointed.count("--gradient_checkpointing") == 1
    assert checkpointed[checkpointed.index("--mixed_precision") + 1] == "no"
    # Any on/off flag of the recipe: the length-grouping pair compares grouped batches with the
    # shuffle. GLUE groups by default: with --no_group_by_length among the recipe's flags the plain
    # arm shuffles and the arm's own flag, written after it, groups (as the recipe parses the line).
    args = parse(
        "--arms", "fp32,fp32+group_by_length", "--output_dir", str(tmp_path / "g"), "--no_group_by_length"
    )
    grouped = paired.launch_command(args, "fp32+group_by_length", 1, tmp_path / "c")
    assert grouped.count("--group_by_length") == 1 and "--group_by_length" not in plain
    assert grouped[grouped.index("--mixed_precision") + 1] == "no"
    args.group, recipe = "grouping", paired.load_recipe(args.recipe_path)  # the group: main() names it
    for arm, grouping in (("fp32", False), ("fp32+group_by_length", True)):
        line = paired.launch_command(args, arm, 1, tmp_path / arm)
        assert recipe.parse_args(line[line.index(str(args.recipe_path)) + 1 :]).group_by_length is grouping


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--arms", "fp32,fp16+compile"],  # the benchmark's modifier; the recipe's flag is --torch_compile
            "--arms: compile is not an on/off flag of bert_glue.py; an arm's +<flag> names one",
        ),
        (["--arms", "fp32,fp17"], "unknown ['fp17']; choose from fp32, fp16, bf16, fp8 (each"),
        (["--arms", "fp32,fp32+max_seq_length"], "max_seq_length is not an on/off flag of bert_glue.py"),
        (  # GLUE groups by default: the pair needs --no_group_by_length among the recipe's flags
            ["--arms", "fp32,fp32+group_by_length"],
            "--group_by_length is already in effect in every run of bert_glue.py (its default or the "
            "recipe's flags), so fp32+group_by_length would run as fp32; turn it off among the "
            "recipe's flags (--no_group_by_length)",
        ),
        (
            [
                "--arms",
                "fp32,fp32+group_by_length",
                "--headroom",
                "--memory_budget_gb",
                "4",
                "--no_group_by_length",
            ],
            "--headroom searches each precision's largest batch (+gradient_checkpointing too), not "
            "fp32+group_by_length",
        ),
        (
            ["--arms", "fp32,bf16+gradient_checkpointing", "--gradient_checkpointing"],
            "turns it on in every arm",
        ),
    ],
)
def test_arm_modifiers_are_checked_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        paired.parse_args([*argv, *glue_flags()])
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_a_seed_whose_arms_started_from_different_weights_is_left_out(tmp_path):
    runs = []
    for seed in (1, 2):
        for arm in ("fp32", "bf16"):
            sha = "a" if (seed, arm) != (2, "bf16") else "b"
            folder = tmp_path / f"{arm}-seed{seed}"
            write_run(folder, **figures(0.8, 10.0, 4e9, arm, sha=sha))
            runs.append({"arm": arm, "seed": seed, "run_dir": str(folder), "status": "finished"})
    comparison = paired.compare(fake_args(["fp32", "bf16"], [1, 2]), runs)
    assert comparison["unpaired_seeds"] == [2]
    assert comparison["vs_fp32"]["bf16"]["seeds"] == [1]
    assert comparison["vs_fp32"]["bf16"]["metrics"]["eval_f1"]["verdict"].startswith("one seed")
    assert "Seeds [2] are left out" in paired.markdown(comparison, None)


# ----------------------------------------------------------------------------- arguments
def parse(*argv):
    return paired.parse_args([*argv, *glue_flags()])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "bf16,fp32"], "start with fp32"),
        (["--arms", "fp32"], "start with fp32"),
        (["--arms", "fp32,fp4"], "unknown ['fp4']"),
        (["--seeds", "three"], "a count (3) or a comma-separated list"),
        (["--seeds", "0"], "at least 1"),
        (["--seeds", "1,1"], "distinct"),
        (["--recipe", "bert_gleu"], "choose from bert_glue"),
        (["--seed", "3"], "--seed: the pairing sets these"),
        (["--mixed_precision", "fp16"], "--mixed_precision: the pairing sets these"),
        (["--run_name", "x"], "--run_name: the pairing sets these"),
        (["--resume_from_checkpoint", "latest"], "--resume_from_checkpoint: the pairing"),
        (["--learning_rate", "-1"], "--learning_rate must be at least 0"),
        (["--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    ],
)
def test_bad_flags_fail_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        parse("--arms", "fp32,bf16", *argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_auto_arms_are_fp32_and_what_auto_picks(monkeypatch):
    import amp_recipes.amp.precision as precision

    monkeypatch.setattr(precision, "resolve_mixed_precision", lambda flag: ("bf16", "an Ampere+ GPU"))
    assert parse("--arms", "auto").arms == ["fp32", "bf16"]
    monkeypatch.setattr(precision, "resolve_mixed_precision", lambda flag: ("no", "no native bf16"))
    with pytest.raises(SystemExit):
        parse("--arms", "auto")


def test_seeds_count_or_list_and_defaults():
    args = parse("--arms", "fp32,fp16", "--seeds", "3")
    assert args.seeds == [1, 2, 3] and args.output_dir == Path("pairs/bert_glue") and args.group is None
    assert parse("--arms", "fp32,fp16", "--seeds", "42,7").seeds == [42, 7]
    args.group = "bert_glue"  # what check_pair_config settles (test_default_group_...)
    command = paired.launch_command(args, "fp16", 2, Path("pairs/x/runs/fp16-seed2"))
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    tail = command[command.index(str(paired.find_recipe(None, "bert_glue"))) + 1 :]
    assert tail[: len(glue_flags())] == glue_flags()
    assert " ".join(tail[len(glue_flags()) :]) == (
        "--mixed_precision fp16 --seed 2 --output_dir pairs/x/runs/fp16-seed2 --run_name bert_glue-fp16-seed2 "
        "--wandb_group bert_glue --wandb_job_type fp16 --wandb_tags fp16,seed2,paired"
    )


def test_another_command_in_the_same_folder_is_refused(tmp_path):
    args = parse("--arms", "fp32,bf16", "--output_dir", str(tmp_path))
    paired.check_pair_config(args)
    paired.check_pair_config(parse("--arms", "fp32,fp16", "--seeds", "5", "--output_dir", str(tmp_path)))
    other = paired.parse_args(
        ["--output_dir", str(tmp_path), "--arms", "fp32,bf16", *glue_flags(seed=None, learning_rate=1e-3)]
    )
    with pytest.raises(SystemExit, match="holds a pair run with other settings \\(recipe_args"):
        paired.check_pair_config(other)


def test_default_group_is_unique_per_pair_and_kept_when_the_pair_resumes(tmp_path, monkeypatch):
    """Two pairs written to folders of one name (pairs/mrpc, here and elsewhere, or after the folder
    was cleared) get groups of their own: the folder's name and the time the pair started. A resumed
    pair keeps its group and its comparison run; another --group in the same folder is refused."""
    from datetime import datetime, timedelta

    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    output_dir = tmp_path / "pairs" / "mrpc"
    output_dir.mkdir(parents=True)
    # The group names the second the pair started, read from the wall clock (time.strftime): a
    # second of slack, for a clock that steps while the pair starts (seen once in CI, 2026-12-08).
    before = datetime.now().replace(microsecond=0) - timedelta(seconds=1)
    args = parse("--arms", "fp32,bf16", "--output_dir", str(output_dir))
    paired.check_pair_config(args)
    name, day, clock = args.group.split("-")
    started = datetime.strptime(f"{day}-{clock}", "%Y%m%d-%H%M%S")
    assert name == "mrpc" and before <= started <= datetime.now()
    record = json.loads((output_dir / "pair.json").read_text())
    assert record["group"] == args.group and len(record["comparison_run_id"]) == 8

    again = parse("--arms", "fp32,bf16", "--output_dir", str(output_dir))
    paired.check_pair_config(again)
    assert (again.group, again.comparison_run_id) == (args.group, record["comparison_run_id"])
    other = parse("--arms", "fp32,bf16", "--output_dir", str(output_dir), "--group", "mine")
    with pytest.raises(SystemExit, match="other settings \\(group: '" + args.group):
        paired.check_pair_config(other)
    # The comparison run's id belongs to one W&B entity: another one for this pair is refused too.
    other = parse("--arms", "fp32,bf16", "--output_dir", str(output_dir), "--wandb_entity", "my-team")
    with pytest.raises(SystemExit, match="other settings \\(wandb_entity: None\\)"):
        paired.check_pair_config(other)


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A machine where nobody ran `wandb login` or `wandb offline`: no key or mode in the
    environment, an empty netrc file, no wandb settings file (global or in the working folder)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    return netrc


@pytest.mark.parametrize(
    ("argv", "wandb_mode", "message"),
    [
        (
            ["--wandb_report", "--report_to", "wandb"],
            "offline",
            "--wandb_report needs the wandb-workspaces package: pip install wandb-workspaces",
        ),
        (["--wandb_report"], "offline", "--wandb_report needs the runs in W&B: pass --report_to wandb"),
        (
            ["--report_to", "wandb"],
            None,
            "--report_to wandb: W&B would run online and this machine is not logged in",
        ),
        (
            ["--report_to", "all"],
            None,
            "--report_to all: W&B would run online and this machine is not logged in",
        ),
    ],
    ids=["no-wandb-workspaces", "report-without-wandb", "not-logged-in", "all"],
)
def test_what_would_fail_late_fails_before_the_first_run(
    argv, wandb_mode, message, tmp_path, monkeypatch, capsys, no_wandb_login
):
    import torch

    if "--wandb_report" in argv:  # the package, as missing as on a machine without it
        monkeypatch.setitem(sys.modules, "wandb_workspaces", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU, on any machine
    if wandb_mode:
        monkeypatch.setenv("WANDB_MODE", wandb_mode)
    output_dir = tmp_path / "pair"
    with pytest.raises(SystemExit) as error:
        paired.main(["--arms", "fp32,bf16", "--output_dir", str(output_dir), *glue_flags(), *argv])
    assert error.value.code == 2 and message in capsys.readouterr().err
    assert not output_dir.exists()  # not one run started, not even the pair's folder


def test_the_wandb_mode_and_where_the_runs_go_are_said_before_the_first_run(
    tmp_path, monkeypatch, capsys, no_wandb_login
):
    # Logged in as `wandb login` writes it: the server's host (and port) in the netrc file.
    no_wandb_login.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    parse("--arms", "fp32,bf16", "--report_to", "wandb", "--wandb_entity", "my-team")
    assert "W&B: online; project amp-recipes, entity my-team." in capsys.readouterr().out
    monkeypatch.setenv("WANDB_BASE_URL", "http://localhost:8080")  # a W&B server of one's own
    with pytest.raises(SystemExit):
        parse("--arms", "fp32,bf16", "--report_to", "wandb")
    no_wandb_login.write_text("machine localhost:8080 login user password 0123456789abcdef\n")
    parse("--arms", "fp32,bf16", "--report_to", "wandb")
    # Offline by WANDB_MODE, or by `wandb offline` (its settings file in the working folder).
    no_wandb_login.write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    parse("--arms", "fp32,bf16", "--report_to", "wandb", "--project_name", "mine")
    assert "W&B: offline; project mine, entity your default." in capsys.readouterr().out
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / "wandb").mkdir()
    (tmp_path / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    parse("--arms", "fp32,bf16", "--report_to", "wandb")
    assert "W&B: offline;" in capsys.readouterr().out


def write_pair(output_dir: Path, seeds=(1, 2, 3)):
    """Finished runs of a pair (fp32 and bf16 over three seeds) and the headroom search's result,
    as the recipe and the benchmark write them."""
    for seed in seeds:
        for arm, f1, accuracy, speed, memory in (
            ("fp32", 0.80 + seed / 100, 0.70, 10.0, 4e9),
            ("bf16", 0.81 + seed / 200, 0.71 + seed / 100, 10.0 + seed, 3e9 - seed * 1e8),
        ):
            results = figures(f1, speed, memory, arm, sha=f"init-{seed}")
            write_run(output_dir / "runs" / f"{arm}-seed{seed}", **results, eval_accuracy=accuracy)
    (output_dir / "headroom").mkdir(parents=True, exist_ok=True)
    bench = {
        "arms": {
            "fp32": {"max_batch_size": 256},
            "bf16": {"max_batch_size": 512, "ratios_vs_fp32": {"headroom": 2.0}},
        },
        "config": {"seq_len": 128, "memory_budget_gb": 6.0},
    }
    (output_dir / "headroom" / "results.json").write_text(json.dumps(bench))


def expected_summary(comparison: dict) -> dict:
    """Every figure the comparison run's summary must hold, read from comparison.json."""
    versus = comparison["vs_fp32"]["bf16"]
    expected = {
        "headroom/memory_budget_gb": 6.0,
        "fp32/headroom_batch": 256,
        "bf16/headroom_batch": 512,
        "bf16/headroom_ratio": 2.0,
        "bf16/seeds": 3,
        "bf16/speedup": versus["speedup"]["mean"],
        "bf16/speedup_sd": versus["speedup"]["sd"],
        "bf16/memory_drop_percent": versus["memory_drop_percent"]["mean"],
        "bf16/memory_drop_percent_sd": versus["memory_drop_percent"]["sd"],
    }
    for name in ("eval_accuracy", "eval_f1"):
        metric = versus["metrics"][name]
        expected[f"bf16/{name}/difference"] = metric["mean"]
        expected[f"bf16/{name}/ci_low"], expected[f"bf16/{name}/ci_high"] = metric["ci"]
        expected[f"bf16/{name}/verdict"] = metric["verdict"]
    return expected


def comparison_runs(wandb_root: Path) -> list:
    """The offline W&B runs of job type `comparison` under wandb_root, oldest first."""
    found = []
    for run_dir in sorted((wandb_root / "wandb").glob("offline-run-*")):
        record, config, _ = offline_run(wandb_root, run_dir)
        if record.job_type == "comparison":
            found.append((run_dir, record, config, offline_summary(wandb_root, run_dir)))
    return found


def check_comparison_run(wandb_root: Path, run_dir: Path, record, config, summary, comparison: dict):
    """The W&B comparison run, read back from its offline records, against comparison.json."""
    assert (
        record.run_group == comparison["group"] and record.display_name == f"{comparison['group']}-comparison"
    )
    assert (config["recipe"], config["arms"], config["seeds"]) == ("bert_glue", ["fp32", "bf16"], [1, 2, 3])
    assert config["recipe_args"] == paired.shlex.join(comparison["recipe_args"])
    assert config["hardware"] == comparison["hardware"]
    assert {"torch", "transformers", "accelerate", "datasets", "evaluate", "wandb"} <= set(config["versions"])
    # The decoder flattens the logged table's and image's references to "runs/path", "comparison/path" ...
    media = {key for key in summary if key.startswith(("runs/", "comparison/", "_"))}
    assert {key: value for key, value in summary.items() if key not in media} == expected_summary(comparison)
    table = json.loads((run_dir / "files" / summary["runs/path"]).read_text())
    assert summary["runs/_type"] == "table-file"
    assert [dict(zip(table["columns"], row, strict=True)) for row in table["data"]] == comparison["rows"]
    image = run_dir / "files" / summary["comparison/path"]
    assert summary["comparison/_type"] == "image-file" and image.read_bytes()[:4] == b"\x89PNG"


def test_the_comparison_is_a_wandb_run_and_tensorboard_scalars_with_comparison_json_figures(
    tmp_path, wandb_dir, monkeypatch, capsys
):
    """`--report_to all` (W&B offline, TensorBoard): the comparison of a finished pair, read back
    as a user would see it, figure for figure against comparison.json; the same command again
    (a resumed pair) updates that W&B run and rewrites the TensorBoard figures."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    output_dir = tmp_path / "pair"
    write_pair(output_dir)
    argv = ["--arms", "fp32,bf16", "--seeds", "3", "--output_dir", str(output_dir), "--compare_only"]
    argv += ["--headroom", "--memory_budget_gb", "6", *glue_flags(), "--report_to", "all"]
    paired.main(argv)
    comparison = json.loads((output_dir / "comparison.json").read_text())
    assert [(row["arm"], row["seed"]) for row in comparison["rows"]] == [
        (arm, seed) for seed in (1, 2, 3) for arm in ("fp32", "bf16")
    ]
    assert (
        comparison["rows"][1]["eval_accuracy"] == 0.72 and comparison["rows"][1]["peak_memory_bytes"] == 2.9e9
    )
    ((run_dir, record, config, summary),) = comparison_runs(wandb_dir)
    check_comparison_run(wandb_dir, run_dir, record, config, summary, comparison)
    # ... and the figures are the pair's own: speeds 11, 12, 13 against 10; memory 2.9, 2.8, 2.7
    # against 4 GB; a capped search of 256 and 512 under the 6 GB it ran with.
    assert summary["bf16/speedup"] == pytest.approx(1.2) and summary[
        "bf16/memory_drop_percent"
    ] == pytest.approx(30.0)
    assert (summary["bf16/headroom_ratio"], summary["headroom/memory_budget_gb"]) == (2.0, 6.0)
    out = capsys.readouterr().out
    assert f"Pair group: {comparison['group']}" in out and f"W&B comparison run {record.run_id}" in out

    def tensorboard_figures():
        (events,) = (output_dir / "logs" / "comparison").glob("events.out.tfevents.*")
        accumulator = EventAccumulator(str(events.parent), size_guidance={"tensors": 0, "scalars": 0})
        accumulator.Reload()
        scalars = {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}
        assert all(len(points) == 1 and points[0].step == 0 for points in scalars.values())
        (text,) = accumulator.Tensors("comparison/text_summary")
        return {tag: points[0].value for tag, points in scalars.items()}, text.tensor_proto.string_val[
            0
        ].decode()

    scalars, text = tensorboard_figures()
    numbers = {k: v for k, v in expected_summary(comparison).items() if not isinstance(v, str)}
    assert scalars.keys() == numbers.keys()
    assert all(scalars[k] == pytest.approx(v, rel=1e-6) for k, v in numbers.items())  # float32 events
    assert "**bf16 vs fp32** (paired by seed, 3 seed(s))" in text

    # The same pair again, with a fourth seed finished since: one comparison run, updated.
    write_pair(output_dir, seeds=(4,))  # (the headroom file is rewritten as it was)
    import wandb

    real_init = wandb.init

    def resumed(**kwargs):  # the summary a resumed online run comes back with: an outdated figure
        run = real_init(**kwargs)
        run.summary["bf16/no_ratio_reason"] = "no bf16 run finished"
        return run

    monkeypatch.setattr(wandb, "init", resumed)
    paired.main([*argv[:2], "--seeds", "4", *argv[4:]])
    comparison = json.loads((output_dir / "comparison.json").read_text())
    (first, second) = comparison_runs(wandb_dir)
    assert first[1].run_id == second[1].run_id  # the same W&B run, resumed
    assert second[2]["seeds"] == [1, 2, 3, 4] and len(comparison["rows"]) == 8
    assert second[3]["bf16/seeds"] == 4 and "bf16/no_ratio_reason" not in second[3]  # removed
    scalars, _ = tensorboard_figures()  # rewritten, not appended
    assert scalars["bf16/speedup"] == pytest.approx(
        comparison["vs_fp32"]["bf16"]["speedup"]["mean"], rel=1e-6
    )


def test_wandb_report_opens_with_the_verdict_then_the_runs(tmp_path):
    output_dir = tmp_path / "pair"
    write_pair(output_dir)
    runs = [
        {
            "arm": arm,
            "seed": seed,
            "run_dir": str(output_dir / "runs" / f"{arm}-seed{seed}"),
            "status": "finished",
        }
        for seed in (1, 2, 3)
        for arm in ("fp32", "bf16")
    ]
    comparison = paired.compare(fake_args(["fp32", "bf16"], [1, 2, 3]), runs)
    comparison["group"] = "mrpc-pair"
    report = paired.build_report(comparison, "amp-recipes", "my-team")
    assert (report.project, report.entity) == ("amp-recipes", "my-team")
    assert report.title == "fp32 vs bf16: mrpc-pair"
    kinds = [type(block).__name__ for block in report.blocks]
    assert kinds == ["H1", "MarkdownBlock", "PanelGrid", "H1", "PanelGrid"]
    assert [report.blocks[0].text, report.blocks[3].text] == ["Verdict", "Runs"]
    assert "**bf16 vs fp32** (paired by seed, 3 seed(s)): speedup" in report.blocks[1].text
    verdict = report.blocks[2]
    (runset,) = verdict.runsets
    assert runset.filters == "Group = 'mrpc-pair' and JobType = 'comparison'"
    assert [type(panel).__name__ for panel in verdict.panels] == [
        "WeavePanelSummaryTable",
        "MediaBrowser",
        "RunComparer",
    ]
    assert verdict.panels[0].table_name == "runs" and verdict.panels[1].media_keys == ["comparison"]
    grid = report.blocks[-1]
    (runset,) = grid.runsets
    assert runset.filters == "Group = 'mrpc-pair' and JobType != 'comparison'" and runset.groupby == [
        "run.jobType"
    ]
    assert (runset.project, runset.entity) == ("amp-recipes", "my-team")
    # The filters as W&B reads them (wandb_workspaces' own parser): the group, and the job type.
    from wandb_workspaces import expr

    for grid_block, op in ((verdict, "="), (grid, "!=")):
        parsed = expr.expr_to_filters(grid_block.runsets[0].filters).filters
        assert [(f.key.name, f.op, f.value) for f in parsed] == [
            ("group", "=", "mrpc-pair"),
            ("jobType", op, "comparison"),
        ]
    plotted = {panel.title: getattr(panel, "y", None) or panel.metrics for panel in grid.panels}
    assert plotted == {
        "training loss": ["loss"],
        "dev metrics": ["eval_accuracy", "eval_f1"],
        "fp16 loss scale": ["loss_scale"],
        "samples/s": ["samples_per_second"],
        "peak memory (bytes)": ["peak_memory_bytes"],
        "training samples/s": ["train_samples_per_second"],
        "final dev metrics": ["eval_accuracy", "eval_f1"],
    }


# ----------------------------------------------------------------------------- headroom
@pytest.mark.slow
def test_headroom_comes_from_the_benchmark_search(tmp_path, monkeypatch):
    """The benchmark's real upward search on the recipe's model and --max_seq_length (narrowed here
    to two trials per arm: 256 and 512, both far inside the budget, so the search is capped)."""
    args = paired.parse_args(
        ["--arms", "fp32,bf16", "--output_dir", str(tmp_path), "--headroom", "--memory_budget_gb", "1.25"]
        + glue_flags(max_seq_length=64)
    )
    commands = []
    real_run = subprocess.run

    def benchmark(command, **kwargs):
        commands.append(command)
        narrowed = ["--search_start", "256", "--search_granularity", "256", "--search_max", "512"]
        return real_run([*command, *narrowed], **kwargs)

    monkeypatch.setattr(paired.subprocess, "run", benchmark)
    headroom = paired.measure_headroom(args)
    (command,) = commands
    assert command[1] == str(REPO / "scripts" / "benchmark_precision.py")
    flags = dict(zip(command[2::2], command[3::2], strict=False))
    assert flags["--arms"] == "fp32,bf16" and flags["--head"] == "sequence" and flags["--seq_len"] == "64"
    assert flags["--model_name_or_path"] == str(TINY_BERT) and flags["--memory_budget_gb"] == "1.25"
    assert flags["--time_limit_s"] == str(paired.HEADROOM_BUDGET_S)  # --headroom_budget_s's default bound
    bench = json.loads((tmp_path / "headroom" / "results.json").read_text())
    assert [trial["batch_size"] for trial in bench["arms"]["bf16"]["trials"]] == [256, 512]
    assert headroom["max_batch_size"] == {"fp32": 512, "bf16": 512}
    assert headroom["capped_at_search_max"] == {"fp32": True, "bf16": True}
    assert headroom["headroom"] == {"bf16": None}  # a lower bound over a lower bound is no ratio
    assert paired.measure_headroom(args) == headroom and len(commands) == 1  # measured once, then read
    # The report shows it beside the fine-tune figures.
    runs = []
    for arm in ("fp32", "bf16"):
        write_run(tmp_path / arm, **figures(0.8, 10.0, 4e9, arm))
        runs.append({"arm": arm, "seed": 1, "run_dir": str(tmp_path / arm), "status": "finished"})
    text = paired.markdown(paired.compare(fake_args(["fp32", "bf16"], [1]), runs), headroom)
    assert "| peak memory (GiB) | max batch |" in text and text.count(" | ≥512 |") == 2
    assert "batch headroom" not in text
    headroom = {**headroom, "max_batch_size": {"fp32": 256, "bf16": 512}, "headroom": {"bf16": 2.0}}
    headroom["capped_at_search_max"] = {"fp32": False, "bf16": False}
    text = paired.markdown(paired.compare(fake_args(["fp32", "bf16"], [1]), runs), headroom)
    assert "| 256 |" in text and "| 512 |" in text and "batch headroom 2.00x" in text


def test_a_headroom_search_cut_by_its_bound_reports_a_lower_bound(tmp_path):
    """--headroom_budget_s: the benchmark stops bf16's search there; the report gives its largest fit
    as a lower bound, no ratio, and says why and what to do."""
    args = paired.parse_args(
        ["--arms", "fp32,bf16", "--output_dir", str(tmp_path), "--headroom", "--memory_budget_gb", "6"]
        + ["--headroom_budget_s", "90"]
        + glue_flags()
    )
    assert args.headroom_budget_s == 90.0
    (tmp_path / "headroom").mkdir()
    bench = {
        "config": {"seq_len": 128, "memory_budget_gb": 6.0, "time_limit_s": 90.0},
        "arms": {
            "fp32": {"max_batch_size": 256, "first_batch_not_fitting": 288, "capped_at_search_max": False},
            "bf16": {"max_batch_size": 256, "capped_at_search_max": True, "search_stopped": "time limit"},
        },
    }
    (tmp_path / "headroom" / "results.json").write_text(json.dumps(bench))
    headroom = paired.measure_headroom(args)
    assert headroom["max_batch_size"] == {"fp32": 256, "bf16": 256} and headroom["headroom"] == {"bf16": None}
    assert headroom["note"].startswith("the search stopped at its bound (90 s, --headroom_budget_s) for bf16")
    runs = []
    for arm in ("fp32", "bf16"):
        write_run(tmp_path / arm, **figures(0.8, 10.0, 4e9, arm))
        runs.append({"arm": arm, "seed": 1, "run_dir": str(tmp_path / arm), "status": "finished"})
    text = paired.markdown(paired.compare(fake_args(["fp32", "bf16"], [1]), runs), headroom)
    assert " | 256 |" in text and " | ≥256 |" in text and "batch headroom" not in text
    assert "Batch headroom: the search stopped at its bound (90 s" in text


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def headless_bert(tmp_path_factory):
    """The tiny BERT without its classifier: each seed draws a new head, as with a pretrained encoder."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    folder = tmp_path_factory.mktemp("headless")
    BertForSequenceClassification.from_pretrained(TINY_BERT).bert.save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_BERT).save_pretrained(folder)
    return folder


def pair_command(output_dir, model, *argv):
    # Every MRPC pair is longer than 16 tokens: all batches are 16 wide, a multiple of 8, so an fp16
    # arm's batches (padded to a multiple of 8) have the very shapes, hence dropout masks, of fp32's.
    flags = glue_flags(model_name_or_path=model, max_train_samples=48, logging_steps=1, num_train_epochs=1)
    flags += ["--max_seq_length", "16"]
    cpu = ["--accelerate_config", REPO / "accelerate_configs" / "cpu.yaml"]
    return [sys.executable, SCRIPT, "--output_dir", output_dir, *cpu, *argv, *flags, "--report_to", "wandb"]


@pytest.mark.slow
def test_pairs_run_resume_and_compare_end_to_end(tmp_path, headless_bert):
    """On a user's copy of the GLUE recipe, outside the repository and renamed throughout, given by its path."""
    copy = tmp_path / "my_task.py"
    copy.write_text((REPO / "recipes" / "bert_glue.py").read_text().replace("bert_glue", "my_task"))
    output_dir = tmp_path / "pair"
    argv = ["--recipe", copy, "--arms", "fp32,bf16", "--seeds", "2", "--wandb_report"]
    first = run(pair_command(output_dir, headless_bert, *argv), tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    comparison = json.loads((output_dir / "comparison.json").read_text())
    results = {
        (arm, seed): json.loads((output_dir / "runs" / f"{arm}-seed{seed}" / "eval_results.json").read_text())
        for arm in ("fp32", "bf16")
        for seed in (1, 2)
    }
    # Same initial weights within a seed, a new classifier head per seed.
    shas = {key: r["initial_weights_sha256"] for key, r in results.items()}
    assert shas["fp32", 1] == shas["bf16", 1] and shas["fp32", 2] == shas["bf16", 2]
    assert shas["fp32", 1] != shas["fp32", 2] and comparison["unpaired_seeds"] == []
    # Each run in its own process, in its precision; the aggregates are the runs' own figures.
    assert {r["precision_in_effect"] for (arm, _), r in results.items() if arm == "bf16"} == {"bf16"}
    for arm in ("fp32", "bf16"):
        for name in ("eval_f1", "train_samples_per_second", "peak_memory_bytes"):
            values = [results[arm, seed][name] for seed in (1, 2)]
            assert comparison["per_arm"][arm][name]["values"] == values
    speedups = [
        results["bf16", s]["train_samples_per_second"] / results["fp32", s]["train_samples_per_second"]
        for s in (1, 2)
    ]
    assert comparison["vs_fp32"]["bf16"]["speedup"]["values"] == pytest.approx(speedups)
    assert (output_dir / "comparison.md").read_text() in first.stdout
    assert (output_dir / "comparison.png").stat().st_size > 10_000
    assert "W&B report built, not saved (W&B is offline)" in first.stdout
    # W&B: one offline run per arm x seed, in the pair's group, job type = arm, tagged, seed in config;
    # and the pair's comparison run, whose figures are comparison.json's.
    group = comparison["group"]
    assert group.startswith("pair-") and f"Pair group: {group}" in first.stdout
    ((_, record, _, summary),) = comparison_runs(tmp_path)
    assert record.run_group == group and f"W&B comparison run {record.run_id} (offline)" in first.stdout
    versus = comparison["vs_fp32"]["bf16"]
    assert summary["bf16/speedup"] == versus["speedup"]["mean"]
    assert summary["bf16/eval_f1/verdict"] == versus["metrics"]["eval_f1"]["verdict"]
    seen = set()
    for run_dir in sorted((tmp_path / "wandb").glob("offline-run-*")):
        record, config, _ = offline_run(tmp_path, run_dir)
        if record.job_type == "comparison":
            continue
        arm, seed = record.job_type, config["seed"]
        assert record.run_group == group and record.display_name == f"{group}-{arm}-seed{seed}"
        assert list(record.tags) == [arm, f"seed{seed}", "paired"]
        assert (
            offline_summary(tmp_path, run_dir)["peak_memory_bytes"] == results[arm, seed]["peak_memory_bytes"]
        )
        seen.add((arm, seed))
    assert seen == set(results)

    # Again, with an fp16 arm whose seed-2 run cannot start (its folder is a file): the four
    # finished runs are not rerun, the failure is reported, the rest still compared.
    (output_dir / "runs" / "fp16-seed2").write_text("in the way")
    mtimes = {
        (arm, seed): (output_dir / "runs" / f"{arm}-seed{seed}" / "eval_results.json").stat().st_mtime_ns
        for arm, seed in results
    }
    second = run(
        pair_command(
            output_dir, headless_bert, "--recipe", copy, "--arms", "fp32,bf16,fp16", "--seeds", "1,2"
        ),
        tmp_path,
    )
    assert second.returncode == 1 and "1 run(s) failed" in second.stderr
    assert second.stdout.count("finished earlier") == 4
    assert all(
        (output_dir / "runs" / f"{arm}-seed{seed}" / "eval_results.json").stat().st_mtime_ns == mtime
        for (arm, seed), mtime in mtimes.items()
    )
    comparison = json.loads((output_dir / "comparison.json").read_text())
    status = {(r["arm"], r["seed"]): r["status"] for r in comparison["runs"]}
    assert status.pop(("fp16", 2)) == "failed" and set(status.values()) == {"finished"}
    failed = next(r for r in comparison["runs"] if r["status"] == "failed")
    assert failed["error"].startswith("error: --output_dir") and "is a file" in failed["error"]
    assert "fp16 seed 2: failed — error: --output_dir" in (output_dir / "comparison.md").read_text()
    assert comparison["vs_fp32"]["bf16"]["seeds"] == [1, 2]
    assert "ran fp32" in comparison["vs_fp32"]["fp16"]["no_ratio_reason"]  # fp16 on a CPU: no verdict
    # fp16 on a CPU computes in fp32: from the same weights, on the same batches in the same order,
    # its losses are fp32's, bit for bit.
    losses = {}
    for arm in ("fp32", "fp16"):
        history = (output_dir / "runs" / f"{arm}-seed1" / "log_history.jsonl").read_text().splitlines()
        losses[arm] = [json.loads(line)["loss"] for line in history if '"loss"' in line]
    assert len(losses["fp32"]) == 6 and losses["fp16"] == losses["fp32"]
    assert "- fp16 seed 2: failed" in (output_dir / "comparison.md").read_text()
    # The resumed pair kept its group, and updated its one comparison run.
    assert comparison["group"] == group
    assert len({record.run_id for _, record, _, _ in comparison_runs(tmp_path)}) == 1
    # --compare_only: runs nothing, reports what is missing.
    third = run(
        pair_command(
            output_dir,
            headless_bert,
            "--recipe",
            copy,
            "--arms",
            "fp32,bf16",
            "--seeds",
            "1,2,4",
            "--compare_only",
        ),
        tmp_path,
    )
    assert third.returncode == 0 and not (output_dir / "runs" / "fp32-seed4").exists()
    assert "- fp32 seed 4: not run" in third.stdout and "[fp32 seed 4]" not in third.stdout
