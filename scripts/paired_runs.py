"""Paired fine-tunes: one recipe in fp32 and in fp16/bf16 over several seeds, and whether the
reduced precision changed the result beyond seed noise.

    python scripts/paired_runs.py --arms fp32,bf16 --seeds 3 --output_dir pairs/mrpc \\
        --accelerate_config accelerate_configs/cpu.yaml \\
        --task_name mrpc --model_name_or_path bert-base-uncased --report_to wandb

Every flag this script does not know goes to the recipe (`--recipe bert_glue` by default, any
recipe name or a copied recipe's path). Each arm x seed is its own `accelerate launch` (your
config file: one GPU, DDP, FSDP, DeepSpeed), into <output_dir>/runs/<arm>-seed<S>, seed-major
(seed 1's arms first), logged to <output_dir>/logs/. Arms of one seed get the same --seed, hence
the same initial weights (checked: each run records their sha256) and the same batches in the
same order. Running the same command again skips the runs that finished (their
eval_results.json exists), resumes those with checkpoints, and reruns the rest.

The comparison goes to <output_dir>/comparison.md, .json and .png and is printed: per arm mean
and sd over seeds of every dev metric, training time, samples/s and peak memory; per reduced
precision arm its speedup and memory drop against fp32 (paired by seed) and the dev-metric
difference with a 95% paired t confidence interval over seeds, and a verdict. With the recipe's
`--report_to wandb` the comparison is also a W&B run of job type `comparison` in the pair's group
(its summary, a table of every arm x seed, the plot), and with `--report_to tensorboard` scalars
and a text in <output_dir>/logs/comparison.
"""

from __future__ import annotations

import argparse
import configparser
import importlib.util
import json
import math
import netrc
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from amp_recipes.amp.precision import MIXED_PRECISION, precision_of

REPO_SCRIPTS = Path(__file__).resolve().parent
NO_WORKSPACES = (
    "--wandb_report needs the wandb-workspaces package: pip install wandb-workspaces "
    "(or pip install -e '.[report]')."
)
IN_EFFECT = {
    "fp32": ("fp32", "tf32"),
    "fp16": ("fp16",),
    "bf16": ("bf16",),
    "fp8": ("fp8",),
}  # what counts as the arm
# A modifier of any arm: "+<flag>", the same arm with one of the recipe's on/off flags given, e.g.
# +gradient_checkpointing, the other memory lever (fp16+gradient_checkpointing), or
# +group_by_length (fp32+group_by_length: what length-grouped batches buy); compared with
# fp32 like any arm. A +gradient_checkpointing arm is also compared with the arm without it.
CHECKPOINTED = "+gradient_checkpointing"


def flags_of(arm: str) -> list[str]:
    """The recipe flags an arm's modifiers give: ["--group_by_length"] for "fp32+group_by_length"."""
    return [f"--{name}" for name in arm.split("+")[1:]]


# Flags the pairing sets on every run; passing them to the recipe would break the pairing.
OWNED = [
    "mixed_precision",
    "seed",
    "output_dir",
    "run_name",
    "wandb_group",
    "wandb_job_type",
    "wandb_tags",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "eval_only",
]
HEADROOM_HEAD = {"bert_glue": "sequence", "bert_ner": "token", "bert_qa": "qa"}  # benchmark --head
# --headroom's default bound. MiniLM-L6 at sequence length 128 (fp32 and bf16, 6 GiB cap) took
# 935 s without one on a 2-core CPU, 525 s with this one, with fresh-process trials
# (docs/paired-runs.md); a GPU's trials take seconds.
HEADROOM_BUDGET_S = 600.0
NOT_METRICS = ("_samples", "_runtime")  # eval_samples(_mm) is a count, not a score


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        allow_abbrev=False,  # an abbreviation must never swallow a recipe flag
        epilog="Every other flag is passed to the recipe (see `python recipes/<recipe>.py --help`).",
    )
    parser.add_argument("--recipe", default="bert_glue", help="Recipe name (amp-recipes ls) or a .py path.")
    parser.add_argument(
        "--arms",
        default="auto",
        help="Comma-separated precisions: fp32,fp16 or fp32,bf16 or fp32,bf16,fp8 (fp32 first, the baseline); auto: "
        "fp32 and what --mixed_precision auto picks on this machine.",
    )
    parser.add_argument(
        "--seeds", default="3", help="A count (3: seeds 1, 2, 3) or a comma-separated list (42,43)."
    )
    parser.add_argument("--output_dir", help="Default: pairs/<recipe>. Holds runs/, logs/, comparison.*")
    parser.add_argument(
        "--group",
        help="W&B group of the pair (default: the output folder's name and the time the pair started, "
        "e.g. mrpc-20261203-180712; a resumed pair keeps its group).",
    )
    parser.add_argument(
        "--accelerate_config", help="`accelerate launch --config_file` for every run (default: accelerate's)."
    )
    parser.add_argument(
        "--headroom",
        action="store_true",
        help="Also measure each arm's largest batch that fits with scripts/benchmark_precision.py (same "
        "model, --max_seq_length, the recipe's head).",
    )
    parser.add_argument(
        "--memory_budget_gb",
        type=float,
        help="Cap for --headroom (default: on a GPU the card; on a CPU the batch is predicted within what is free).",
    )
    parser.add_argument(
        "--headroom_budget_s",
        type=float,
        default=HEADROOM_BUDGET_S,
        help=f"Seconds --headroom may take in all (default {HEADROOM_BUDGET_S:.0f}), each arm an equal share: "
        "a search cut there reports its largest fit as a lower bound (≥N) and no headroom ratio.",
    )
    parser.add_argument(
        "--headroom_head",
        choices=["sequence", "token", "qa"],
        help="Task head for --headroom (a copied recipe).",
    )
    parser.add_argument(
        "--wandb_report",
        action="store_true",
        help="Build a W&B Report of the pair (needs `pip install wandb-workspaces`); saved when online.",
    )
    parser.add_argument(
        "--wandb_entity",
        help="W&B entity (user or team) of every run of the pair, the comparison run and the report "
        "(default: WANDB_ENTITY, else your default entity).",
    )
    parser.add_argument("--compare_only", action="store_true", help="Run nothing; compare what finished.")
    args, recipe_args = parser.parse_known_args(argv)
    if recipe_args[:1] == ["--"]:
        recipe_args = recipe_args[1:]
    args.recipe_args = recipe_args
    args.recipe_path = find_recipe(parser, args.recipe)
    args.recipe_name = args.recipe_path.stem
    args.seeds = parse_seeds(parser, args.seeds)
    args.arms = parse_arms(parser, args.arms)
    args.output_dir = Path(args.output_dir or Path("pairs") / args.recipe_name)
    args.wandb_entity = args.wandb_entity or os.environ.get("WANDB_ENTITY")  # None: your default entity
    if args.memory_budget_gb is not None and not args.memory_budget_gb > 0:
        parser.error(f"--memory_budget_gb must be positive, not {args.memory_budget_gb}.")
    args.recipe_defaults = check_recipe_args(parser, args)
    from amp_recipes.measure.report import trackers

    args.trackers = trackers(args.recipe_defaults["report_to"])
    check_before_runs(parser, args)
    return args


def wandb_mode() -> str:
    """online, offline, disabled (or shared): the mode every W&B run of the pair starts in, from
    WANDB_MODE, else what `wandb offline` / `wandb online` saved in ./wandb/settings (this folder) or
    in wandb's global settings file."""
    mode = os.environ.get("WANDB_MODE")
    if not mode:
        settings = configparser.ConfigParser()
        config_dir = os.environ.get("WANDB_CONFIG_DIR") or Path("~/.config/wandb").expanduser()
        settings.read([Path(config_dir) / "settings", Path("wandb") / "settings"])  # the local one wins
        mode = settings.get("default", "mode", fallback="online")
    mode = mode.lower()
    return "offline" if mode == "dryrun" else mode


def wandb_logged_in() -> bool:
    """What `wandb login` leaves: an API key in WANDB_API_KEY (or an identity token file), or the
    W&B server's entry in the netrc file ($NETRC, else ~/.netrc or ~/_netrc), found as wandb finds
    it (by the server URL's host and port). Read here, without a network call."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    server = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    if os.environ.get("NETRC"):
        paths = [Path(os.environ["NETRC"]).expanduser()]
    else:
        paths = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in paths:
        try:
            if netrc.netrc(path).authenticators(server) is not None:
                return True
        except (OSError, netrc.NetrcParseError):
            continue
    return False


def check_before_runs(parser, args) -> None:
    """What would otherwise fail after hours of fine-tunes fails now, before the first run."""
    if args.wandb_report and "wandb" not in args.trackers:
        parser.error("--wandb_report needs the runs in W&B: pass --report_to wandb (or all) for the recipe.")
    if args.wandb_report and importlib.util.find_spec("wandb_workspaces") is None:
        parser.error(NO_WORKSPACES)
    modified = [arm for arm in args.arms if "+" in arm and arm != precision_of(arm) + CHECKPOINTED]
    if args.headroom and modified:
        parser.error(
            f"--headroom searches each precision's largest batch (+gradient_checkpointing too), not "
            f"{', '.join(modified)}: drop --headroom, or compare those arms in a pair of their own."
        )
    if "wandb" in args.trackers:
        mode = wandb_mode()
        if mode == "online" and not wandb_logged_in():
            parser.error(
                f"--report_to {args.recipe_defaults['report_to']}: W&B would run online and this machine "
                "is not logged in: run `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline "
                "(or run `wandb offline`) to keep the runs on this disk and upload them later with "
                "`wandb sync --sync-all`."
            )
        print(
            f"W&B: {mode}; project {args.recipe_defaults['project_name']}, entity "
            f"{args.wandb_entity or 'your default'}.",
            flush=True,
        )


def find_recipe(parser, recipe: str) -> Path:
    from amp_recipes.errors import InputError
    from amp_recipes.shipped import recipe_file

    try:
        return recipe_file(recipe)
    except InputError as error:
        parser.error(str(error))


def parse_seeds(parser, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        parser.error(
            f"--seeds takes a count (3) or a comma-separated list of integers (1,2,3), not {text!r}."
        )
    if len(values) == 1 and "," not in text:
        if values[0] < 1:
            parser.error(f"--seeds {text}: give at least 1.")
        values = list(range(1, values[0] + 1))
    if len(set(values)) != len(values) or not values or min(values) < 0:
        parser.error(f"--seeds {text}: give distinct non-negative seeds.")
    return values


def parse_arms(parser, text: str) -> list[str]:
    arms = [arm.strip() for arm in text.split(",") if arm.strip()]
    if arms == ["auto"]:
        from amp_recipes.amp.precision import resolve_mixed_precision

        chosen, reason = resolve_mixed_precision("auto")
        if chosen == "no":
            parser.error(
                f"--arms auto: {reason}, so there is no mixed precision to compare here; name the arms "
                "(--arms fp32,bf16) to run one anyway."
            )
        print(f"--arms auto: fp32 and {chosen} ({reason})")
        return ["fp32", chosen]
    unknown = [arm for arm in arms if precision_of(arm) not in IN_EFFECT]
    if unknown or not arms:
        parser.error(
            f"--arms: unknown {unknown or text!r}; choose from {', '.join(IN_EFFECT)} (each may end in "
            f"+<flag>, an on/off flag of the recipe: {CHECKPOINTED}) or auto."
        )
    if arms[0] != "fp32" or len(arms) < 2 or len(set(arms)) != len(arms):
        parser.error(
            f"--arms {text}: start with fp32 (the baseline) and add fp16, bf16 and/or fp8, once each "
            f"(and any of them, fp32 too, with {CHECKPOINTED})."
        )
    return arms


def load_recipe(path: Path):
    spec = importlib.util.spec_from_file_location(f"paired_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_recipe_args(parser, args) -> dict:
    """Parse the recipe's flags with the recipe's own parser now (a typo fails in a second, not
    after the first run), refuse the flags the pairing sets, and return the recipe's settings."""
    recipe = load_recipe(args.recipe_path)
    recipe_parser = recipe.build_parser()
    try:
        raw = recipe_parser.parse_args(args.recipe_args)  # the flags as given, before any default is filled
        parsed = recipe.parse_args(args.recipe_args)  # the recipe's own checks too
    except SystemExit as error:
        if error.code:
            parser.error(
                f"the flags for {args.recipe_path.name} above are not valid: {shlex.join(args.recipe_args)}"
            )
        raise
    for flag in {flag for arm in args.arms for flag in flags_of(arm)}:
        action = recipe_parser._option_string_actions.get(flag)
        if action is None or action.nargs != 0:
            parser.error(
                f"--arms: {flag[2:]} is not an on/off flag of {args.recipe_path.name}; an arm's +<flag> "
                "names one (+gradient_checkpointing, +group_by_length)."
            )
    if getattr(parsed, "gradient_checkpointing", False) and any(
        arm.endswith(CHECKPOINTED) for arm in args.arms
    ):
        parser.error(
            f"--gradient_checkpointing in the recipe's flags turns it on in every arm; drop it, or the "
            f"{CHECKPOINTED} arms, which compare an arm with and without it."
        )
    for arm in args.arms:
        for flag in flags_of(arm):
            action = recipe_parser._option_string_actions[flag]
            if getattr(parsed, action.dest, None) == action.const:  # the arm would equal its precision's
                off = f"--no_{flag[2:]}"
                hint = f" ({off})" if off in recipe_parser._option_string_actions else ""
                parser.error(
                    f"--arms: {flag} is already in effect in every run of {args.recipe_path.name} (its "
                    f"default or the recipe's flags), so {arm} would run as {precision_of(arm)}; turn it "
                    f"off among the recipe's flags{hint} to compare with and without it."
                )
    taken = [f"--{name}" for name in OWNED if getattr(raw, name, None) != recipe_parser.get_default(name)]
    if taken:
        parser.error(
            f"{', '.join(taken)}: the pairing sets these on every run (--arms, --seeds, --output_dir, "
            "--group); drop them from the recipe's flags."
        )
    return vars(parsed)


# ----------------------------------------------------------------------------- the runs
def run_dir(args, arm: str, seed: int) -> Path:
    return args.output_dir / "runs" / f"{arm}-seed{seed}"


def launch_command(args, arm: str, seed: int, folder: Path) -> list[str]:
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    if args.accelerate_config:
        launcher += ["--config_file", args.accelerate_config]
    flags = [
        *args.recipe_args,
        *("--mixed_precision", MIXED_PRECISION[precision_of(arm)]),
        *flags_of(arm),  # its modifiers: --gradient_checkpointing, --group_by_length, ...
        *("--seed", str(seed), "--output_dir", str(folder)),
        *("--run_name", f"{args.group}-{arm}-seed{seed}", "--wandb_group", args.group),
        *("--wandb_job_type", arm, "--wandb_tags", f"{arm},seed{seed},paired"),
    ]
    if (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir()):
        flags += ["--resume_from_checkpoint", "latest"]  # an interrupted run continues
    elif folder.is_dir() and any(folder.iterdir()):
        flags += ["--overwrite_output_dir"]  # a failed run without checkpoints starts again
    return [*launcher, str(args.recipe_path), *flags]


def run_one(args, arm: str, seed: int) -> dict:
    """One arm x seed in its own `accelerate launch`, its output shown and kept in logs/."""
    folder = run_dir(args, arm, seed)
    entry = {"arm": arm, "seed": seed, "run_dir": str(folder)}
    if (folder / "eval_results.json").is_file():
        print(f"[{arm} seed {seed}] finished earlier: {folder}/eval_results.json", flush=True)
        return {**entry, "status": "finished", "skipped": True}
    if args.compare_only:
        return {**entry, "status": "not run"}
    log = args.output_dir / "logs" / f"{arm}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = launch_command(args, arm, seed, folder)
    print(f"[{arm} seed {seed}] {shlex.join(command)}", flush=True)
    started = time.monotonic()
    with open(log, "wb") as handle:
        handle.write(f"$ {shlex.join(command)}\n".encode())
        env = {**os.environ, **({"WANDB_ENTITY": args.wandb_entity} if args.wandb_entity else {})}
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            while chunk := os.read(process.stdout.fileno(), 65536):  # progress bars too, as they come
                handle.write(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            returncode = process.wait()
        # Ctrl-C reached the run too: it stops after its step, with a checkpoint (within the
        # launcher's grace: docs/checkpoints.md); the launcher's relay of it is not a second Ctrl-C.
        except KeyboardInterrupt:
            process.wait()
            raise SystemExit(
                f"interrupted during {arm} seed {seed}; run the same command again to continue (finished "
                "runs are kept, a run with checkpoints resumes)."
            ) from None
    entry.update(log=str(log), wall_seconds=round(time.monotonic() - started, 1), returncode=returncode)
    if returncode == 0 and (folder / "eval_results.json").is_file():
        return {**entry, "status": "finished"}
    lines = log.read_bytes().decode(errors="replace").splitlines()
    # The recipe's own one-line `error: ...`, if it printed one (accelerate launch's traceback follows it).
    error = next((line for line in reversed(lines) if line.startswith("error: ")), None)
    print(
        f"[{arm} seed {seed}] FAILED (exit {returncode}){f': {error}' if error else ''}; see {log}",
        flush=True,
    )
    return {**entry, "status": "failed", "error": error, "last_lines": lines[-5:]}


def check_pair_config(args) -> None:
    """<output_dir>/pair.json: the recipe, its flags and the W&B group. Another command in the same
    folder would mix runs that are not pairs of each other; arms and seeds may be added.

    The group is --group, else the one this folder's pair already has (a resumed pair keeps it),
    else the folder's name and the time now, so two pairs written to folders of one name never share
    a group. pair.json also keeps the id of the pair's W&B comparison run, which every later
    comparison of this pair updates."""
    path = args.output_dir / "pair.json"
    before = json.loads(path.read_text()) if path.is_file() else {}
    if args.group is None:
        args.group = (
            before.get("group") or f"{args.output_dir.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    config = {
        "recipe": args.recipe_name,
        "recipe_args": args.recipe_args,
        "accelerate_config": args.accelerate_config,
        "group": args.group,
        # The comparison run's id is only that entity's: another entity would make a second run.
        "wandb_entity": args.wandb_entity,
    }
    if before:
        changed = [key for key in config if before.get(key) != config[key]]
        if changed:
            raise SystemExit(
                f"error: {args.output_dir} holds a pair run with other settings ({', '.join(changed)}: "
                f"{', '.join(repr(before.get(k)) for k in changed)}); give another --output_dir, or "
                "run the pair with its own settings (without --group, it keeps its group)."
            )
    args.comparison_run_id = before.get("comparison_run_id") or secrets.token_hex(4)
    from amp_recipes.training.outputs import write_json_atomic

    write_json_atomic(path, {**config, "comparison_run_id": args.comparison_run_id})


# ----------------------------------------------------------------------------- statistics
def mean_sd(values: list[float]) -> dict:
    """Mean and sample sd (n - 1); NaN where there are too few values."""
    n = len(values)
    mean = statistics.fmean(values) if n else math.nan
    sd = statistics.stdev(values) if n > 1 else math.nan
    return {"mean": mean, "sd": sd, "n": n, "values": values}


def paired_interval(differences: list[float], confidence: float = 0.95) -> dict:
    """Mean of the per-seed differences (arm - fp32) and its two-sided paired t confidence
    interval: mean +- t(1 - alpha/2, n - 1) * sd / sqrt(n). Needs 2 seeds or more."""
    from scipy.stats import t

    stats = mean_sd(differences)
    n = stats["n"]
    if n < 2:
        return {**stats, "half_width": math.nan, "ci": [math.nan, math.nan], "confidence": confidence}
    half = t.ppf(0.5 + confidence / 2, n - 1) * stats["sd"] / math.sqrt(n)
    return {
        **stats,
        "half_width": half,
        "ci": [stats["mean"] - half, stats["mean"] + half],
        "confidence": confidence,
    }


def verdict(arm: str, interval: dict) -> str:
    if interval["n"] == 0:
        return "no seed with both arms finished: no verdict"
    if interval["n"] < 2:
        return "one seed: no verdict (seed noise cannot be estimated; run --seeds 3 or more)"
    low, high = interval["ci"]
    if low <= 0 <= high:
        return "within seed noise"
    direction = "lower" if interval["mean"] < 0 else "higher"
    return f"{arm} {direction} by {abs(interval['mean']):.4g} ± {interval['half_width']:.4g}"


def metric_names(results: list[dict]) -> list[str]:
    names = set()
    for result in results:
        names |= {
            key
            for key, value in result.items()
            if key.startswith("eval_")
            and isinstance(value, (int, float))
            and not any(part in key for part in NOT_METRICS)
        }
    return sorted(names)


FIGURES = {  # eval_results.json key -> (how the report names it, its unit in bytes or 1)
    "train_runtime_seconds": ("train time (s)", 1),
    "train_samples_per_second": ("samples/s", 1),
    "peak_memory_bytes": ("peak memory (GiB)", 2**30),
}


def speed_and_memory(results: dict, arm: str, base: str, seeds: list[int]) -> dict:
    """`arm` against `base`, paired by seed: the speedup and the peak-memory drop (%)."""
    return {
        "speedup": mean_sd(
            [
                results[arm, s]["train_samples_per_second"] / results[base, s]["train_samples_per_second"]
                for s in seeds
            ]
        ),
        "memory_drop_percent": mean_sd(
            [
                100 * (1 - results[arm, s]["peak_memory_bytes"] / results[base, s]["peak_memory_bytes"])
                for s in seeds
            ]
        ),
    }


def compare(args, runs: list[dict]) -> dict:
    """Everything the report shows, from the finished runs' eval_results.json."""
    results = {}
    for entry in runs:
        if entry["status"] == "finished":
            path = Path(entry["run_dir"]) / "eval_results.json"
            results[entry["arm"], entry["seed"]] = json.loads(path.read_text())
    names = metric_names(list(results.values()))
    arms = {}
    for arm in args.arms:
        mine = {seed: r for (a, seed), r in results.items() if a == arm}
        in_effect = sorted({r.get("precision_in_effect", "?") for r in mine.values()})
        # torchao's emulated fp8 (fp8 rounding, matmuls in high precision): its scores are fp8's,
        # its time and memory are not, so those are left out.
        emulated = any(r.get("fp8_emulated") for r in mine.values())
        arms[arm] = {
            "precision_in_effect": in_effect,
            "fp8_emulated": emulated,
            "seeds": sorted(mine),
            **{name: mean_sd([mine[s][name] for s in sorted(mine) if name in mine[s]]) for name in names},
            **{
                key: mean_sd([] if emulated else [mine[s][key] for s in sorted(mine) if key in mine[s]])
                for key in FIGURES
            },
        }
    initial = {}  # seed -> {arm: sha256}
    for (arm, seed), r in results.items():
        initial.setdefault(seed, {})[arm] = r.get("initial_weights_sha256")
    # None: not recorded (ZeRO-3 partitions the weights as they load); only a real mismatch unpairs.
    unpaired = sorted(seed for seed, shas in initial.items() if len(set(shas.values()) - {None}) > 1)
    versus = {}
    for arm in args.arms[1:]:
        ran = [r.get("precision_in_effect") for (a, _), r in results.items() if a == arm]
        if not ran:
            versus[arm] = {"no_ratio_reason": f"no {arm} run finished"}
            continue
        if any(p not in IN_EFFECT[precision_of(arm)] for p in ran):
            versus[arm] = {
                "no_ratio_reason": f"requested {arm} but ran {', '.join(sorted(set(ran)))} (e.g. fp16 on a CPU, "
                "which accelerate runs in fp32): no ratio and no verdict"
            }
            continue
        seeds = [
            s for s in args.seeds if (arm, s) in results and ("fp32", s) in results and s not in unpaired
        ]
        arm_r = {s: results[arm, s] for s in seeds}
        base = {s: results["fp32", s] for s in seeds}
        versus[arm] = {"seeds": seeds, **speed_and_memory(results, arm, "fp32", seeds), "metrics": {}}
        if arms[arm]["fp8_emulated"]:
            versus[arm].update(speedup=mean_sd([]), memory_drop_percent=mean_sd([]))
            versus[arm]["speed_note"] = (
                "fp8 was emulated (fp8 rounding, matmuls in high precision): no speed or memory ratio"
            )
        for name in names:
            paired = [s for s in seeds if name in arm_r[s] and name in base[s]]
            interval = paired_interval([arm_r[s][name] - base[s][name] for s in paired])
            versus[arm]["metrics"][name] = {**interval, "verdict": verdict(arm, interval)}
    without_checkpointing = {}  # gradient checkpointing alone: each such arm against the arm keeping activations
    for arm in args.arms:
        kept = precision_of(arm)
        if arm != kept + CHECKPOINTED or kept not in args.arms or "no_ratio_reason" in versus.get(arm, {}):
            continue
        seeds = [s for s in args.seeds if (arm, s) in results and (kept, s) in results and s not in unpaired]
        without_checkpointing[arm] = {
            "against": kept,
            "seeds": seeds,
            **speed_and_memory(results, arm, kept, seeds),
        }
    hardware_keys = ("device_name", "device_type", "num_processes", "distributed_type", "torch_threads")
    first = next(iter(results.values()), {})
    rows = []  # every arm x seed, as its eval_results.json has it (a run that did not finish: status only)
    for entry in runs:
        result = results.get((entry["arm"], entry["seed"]), {})
        row = {key: entry[key] for key in ("arm", "seed", "status")}
        row["precision_in_effect"] = result.get("precision_in_effect")
        row["fp8_emulated"] = bool(result.get("fp8_emulated"))
        rows.append({**row, **{key: result.get(key) for key in [*names, *FIGURES, "initial_weights_sha256"]}})
    return {
        "group": args.group,
        "recipe": args.recipe_name,
        "recipe_args": args.recipe_args,
        "arms": args.arms,
        "seeds": args.seeds,
        "metrics": names,
        "hardware": {k: first.get(k) for k in hardware_keys},
        "runs": runs,
        "rows": rows,
        "initial_weights_sha256": {str(seed): shas for seed, shas in sorted(initial.items())},
        "unpaired_seeds": unpaired,
        "per_arm": arms,
        "vs_fp32": versus,
        "vs_without_checkpointing": without_checkpointing,
        "statistics": "paired t: 95% confidence interval of the mean per-seed difference (arm - fp32)",
    }


# ----------------------------------------------------------------------------- report
def fmt(stats: dict, scale: float = 1.0, digits: int = 4) -> str:
    if not stats.get("n"):
        return "—"
    mean = stats["mean"] / scale
    if stats["n"] < 2:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {stats['sd'] / scale:.2g}"


def markdown(comparison: dict, headroom: dict | None) -> str:
    from amp_recipes.measure import report

    arms, names = comparison["arms"], comparison["metrics"]
    hw = comparison["hardware"]
    lines = [
        f"# Paired runs: {comparison['group']}",
        "",
        f"`{comparison['recipe']}` {shlex.join(comparison['recipe_args'])}",
        "",
        f"Seeds {', '.join(map(str, comparison['seeds']))}; {hw.get('device_name')} "
        f"({hw.get('num_processes')} process(es), {hw.get('distributed_type')}). Mean ± sd over seeds.",
        "",
    ]
    header = ["arm", "in effect", "seeds", *names, *(label for label, _ in FIGURES.values())]
    if headroom:
        header.append("max batch")
    rows = []
    for arm in arms:
        a = comparison["per_arm"][arm]
        in_effect = ", ".join(a["precision_in_effect"]) or "—"
        cells = [arm, in_effect + (" (emulated)" if a.get("fp8_emulated") else ""), str(len(a["seeds"]))]
        cells += [fmt(a[name]) for name in names]
        cells += [fmt(a[key], scale) for key, (_, scale) in FIGURES.items()]
        if headroom:
            size = headroom.get("max_batch_size", {}).get(arm)
            capped = headroom.get("capped_at_search_max", {}).get(arm)
            cells.append("—" if not size else f"≥{size}" if capped else str(size))
        rows.append(cells)
    lines += [*report.table(header, rows), ""]
    for arm, v in comparison["vs_fp32"].items():
        if "no_ratio_reason" in v:
            lines += [f"**{arm} vs fp32**: {v['no_ratio_reason']}.", ""]
            continue
        speed = v.get("speed_note") or (
            f"speedup {fmt(v['speedup'], digits=3)}x, peak-memory drop {fmt(v['memory_drop_percent'], digits=3)}%"
        )
        lines += [
            f"**{arm} vs fp32** (paired by seed, {len(v['seeds'])} seed(s)): {speed}"
            + (
                f", batch headroom {headroom['headroom'][arm]:.2f}x"
                if headroom and (headroom.get("headroom") or {}).get(arm)
                else ""
            )
            + ".",
            "",
        ]
        rows = [
            [
                name,
                f"{m['mean']:+.4f}",
                "—" if math.isnan(m["ci"][0]) else f"[{m['ci'][0]:+.4f}, {m['ci'][1]:+.4f}]",
            ]
            + [m["verdict"]]
            for name, m in v["metrics"].items()
        ]
        lines += [*report.table(["metric", "difference (arm − fp32)", "95% CI", "verdict"], rows), ""]
    for arm, v in comparison.get("vs_without_checkpointing", {}).items():
        lines += [
            f"**{arm} vs {v['against']}** (gradient checkpointing alone, paired by seed, {len(v['seeds'])} "
            f"seed(s)): speedup {fmt(v['speedup'], digits=3)}x, peak-memory drop "
            f"{fmt(v['memory_drop_percent'], digits=3)}%"
            + (
                f", batch headroom {headroom['headroom_without_checkpointing'][arm]:.2f}x"
                if headroom and (headroom.get("headroom_without_checkpointing") or {}).get(arm)
                else ""
            )
            + ".",
            "",
        ]
    if comparison["unpaired_seeds"]:
        lines += [
            f"Seeds {comparison['unpaired_seeds']} are left out of the ratios: their arms did not start from "
            "the same initial weights (their initial_weights_sha256 differ).",
            "",
        ]
    if headroom and headroom.get("note"):
        lines += [f"Batch headroom: {headroom['note']}", ""]
    failed = [r for r in comparison["runs"] if r["status"] != "finished"]
    for run in failed:
        lines.append(
            f"- {run['arm']} seed {run['seed']}: {run['status']}"
            + (f" — {run['error']}" if run.get("error") else "")
            + (f" (log: {run['log']})" if run.get("log") else "")
        )
    lines += ["", f'Statistics: {comparison["statistics"]}; "within seed noise" = the interval contains 0.']
    return "\n".join(lines) + "\n"


def plot(comparison: dict, path: Path) -> None:
    """One panel per figure: each seed's value per arm (a line joins a seed's arms: the pairing),
    and each arm's mean as a short bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, panels = comparison["arms"], [*comparison["metrics"], *FIGURES]
    figure, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    for axis, name in zip(axes[0], panels, strict=True):
        label, scale = FIGURES.get(name, (name, 1))
        per_arm = {arm: comparison["per_arm"][arm] for arm in arms}
        for seed in comparison["seeds"]:
            points = [
                (x, stats[name]["values"][stats["seeds"].index(seed)] / scale)
                for x, stats in enumerate(per_arm.values())
                if seed in stats["seeds"] and len(stats[name]["values"]) == len(stats["seeds"])
            ]
            if points:
                axis.plot(
                    *zip(*points, strict=True), color="#999999", linewidth=0.8, marker="o", markersize=4
                )
        for x, stats in enumerate(per_arm.values()):
            if stats[name]["n"]:
                axis.hlines(stats[name]["mean"] / scale, x - 0.2, x + 0.2, color="#e65100", linewidth=2.5)
        axis.set_xticks(range(len(arms)), arms)
        axis.set_xlim(-0.5, len(arms) - 0.5)
        axis.set_title(label, fontsize=9)
    figure.suptitle(f"{comparison['group']}: dots = seeds (a line per seed), bars = means", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ----------------------------------------------------------------------------- headroom
def measure_headroom(args) -> dict:
    """Each arm's largest batch that fits, from the benchmark's (the measurement engine's) search on
    the recipe's model and --max_seq_length. Reused when it was measured before."""
    folder = args.output_dir / "headroom"
    results_file = folder / "results.json"
    head = args.headroom_head or HEADROOM_HEAD.get(args.recipe_name)
    if head is None:
        return {"note": f"not measured: give --headroom_head for {args.recipe_name} (sequence, token or qa)"}
    if not results_file.is_file():
        defaults = args.recipe_defaults
        command = [
            sys.executable,
            str(REPO_SCRIPTS / "benchmark_precision.py"),
            *("--arms", ",".join(args.arms), "--head", head, "--seq_len", str(defaults["max_seq_length"])),
            *("--model_name_or_path", defaults["model_name_or_path"], "--output_dir", str(folder)),
            *("--batch_size", str(defaults["per_device_train_batch_size"]), "--warmup_steps", "1"),
            *("--timed_steps", "2", "--search_start", str(defaults["per_device_train_batch_size"])),
        ]
        if args.memory_budget_gb:
            command += ["--memory_budget_gb", str(args.memory_budget_gb)]
        command += ["--time_limit_s", str(args.headroom_budget_s)]
        print(
            f"[headroom] each arm's timed steps, then its largest batch (a line per trial), in at most "
            f"{args.headroom_budget_s:.0f} s (--headroom_budget_s): {shlex.join(command)}",
            flush=True,
        )
        if subprocess.run(command).returncode != 0:
            return {"note": f"the benchmark failed (command above); rerun it by hand: {shlex.join(command)}"}
    bench = json.loads(results_file.read_text())
    arms = {arm: bench["arms"].get(arm, {}) for arm in args.arms}
    cut = [arm for arm, r in arms.items() if r.get("search_stopped") or r.get("not_run")]
    stopped = (
        f"the search stopped at its bound ({bench['config'].get('time_limit_s'):.0f} s, --headroom_budget_s) "
        f"for {', '.join(cut)}: a ≥ batch is the largest that fitted before it, a lower bound; rerun with a "
        f"larger --headroom_budget_s (delete {folder} first) for the whole search"
        if cut and bench["config"].get("time_limit_s")
        else None
    )
    return {
        "max_batch_size": {arm: r.get("max_batch_size") for arm, r in arms.items()},
        "capped_at_search_max": {arm: bool(r.get("capped_at_search_max")) for arm, r in arms.items()},
        "headroom": {arm: (arms[arm].get("ratios_vs_fp32") or {}).get("headroom") for arm in args.arms[1:]},
        "headroom_without_checkpointing": {
            arm: (arms[arm].get("ratios_vs_without_checkpointing") or {}).get("headroom")
            for arm in args.arms
            if arm.endswith(CHECKPOINTED)
        },
        # the search's budget, as it ran: --memory_budget_gb, else the card's (or what a CPU had free)
        "memory_budget_gb": bench["config"].get("memory_budget_gb")
        or next((r["budget_bytes"] / 2**30 for r in arms.values() if r.get("budget_bytes")), None),
        "note": bench.get("search_note")
        or stopped
        or f"largest batch at {bench['config']['seq_len']} tokens, {head} head, from {results_file}",
        "results": str(results_file),
    }


# ----------------------------------------------------------------------------- W&B and TensorBoard
def comparison_summary(comparison: dict) -> dict:
    """The verdict as flat figures (comparison.json's, NaN as None), per reduced arm: speedup,
    peak-memory drop, batch headroom, and each dev metric's mean difference, 95% interval and verdict."""
    summary = {}
    headroom = comparison.get("headroom") or {}
    if headroom:
        summary["headroom/memory_budget_gb"] = headroom.get("memory_budget_gb")
        summary["fp32/headroom_batch"] = (headroom.get("max_batch_size") or {}).get("fp32")
    for arm, versus in comparison["vs_fp32"].items():
        if "no_ratio_reason" in versus:
            summary[f"{arm}/no_ratio_reason"] = versus["no_ratio_reason"]
            continue
        summary[f"{arm}/seeds"] = len(versus["seeds"])
        for figure in ("speedup", "memory_drop_percent"):
            summary[f"{arm}/{figure}"] = versus[figure]["mean"]
            summary[f"{arm}/{figure}_sd"] = versus[figure]["sd"]
        if versus.get("speed_note"):
            summary[f"{arm}/speed_note"] = versus["speed_note"]
        if headroom:
            summary[f"{arm}/headroom_batch"] = (headroom.get("max_batch_size") or {}).get(arm)
            summary[f"{arm}/headroom_ratio"] = (headroom.get("headroom") or {}).get(arm)
        for name, metric in versus["metrics"].items():
            summary[f"{arm}/{name}/difference"] = metric["mean"]
            summary[f"{arm}/{name}/ci_low"], summary[f"{arm}/{name}/ci_high"] = metric["ci"]
            summary[f"{arm}/{name}/verdict"] = metric["verdict"]
    for arm, versus in comparison.get("vs_without_checkpointing", {}).items():
        for figure in ("speedup", "memory_drop_percent"):
            summary[f"{arm}/vs_{versus['against']}/{figure}"] = versus[figure]["mean"]
        if headroom:
            summary[f"{arm}/vs_{versus['against']}/headroom_ratio"] = (
                headroom.get("headroom_without_checkpointing") or {}
            ).get(arm)
    return summary


def log_comparison(args, comparison: dict, table: str) -> list[str]:
    """The pair's comparison as a W&B run of job type `comparison` in the pair's group (its summary:
    comparison_summary; a table of every arm x seed, comparison.json's rows; comparison.png; the
    pair's config; its id is in pair.json: a resumed pair updates the same run), and as TensorBoard
    scalars and text in <output_dir>/logs/comparison, rewritten at every comparison of the pair."""
    from amp_recipes.amp.hardware import library_versions
    from amp_recipes.measure import report

    columns = list(comparison["rows"][0]) if comparison["rows"] else ["arm", "seed", "status"]
    config = {
        "recipe": comparison["recipe"],
        "recipe_args": shlex.join(comparison["recipe_args"]),
        "arms": comparison["arms"],
        "seeds": comparison["seeds"],
        "hardware": comparison["hardware"],
        "versions": library_versions(),
    }
    where = report.log_run(
        [name for name in args.trackers if name != "wandb" or wandb_mode() != "disabled"],
        args.recipe_defaults["project_name"],
        f"{comparison['group']}-comparison",
        config,
        comparison_summary(comparison),
        wandb_kwargs={
            "entity": args.wandb_entity,  # None: the default entity, as for the runs
            "group": comparison["group"],
            "job_type": "comparison",
            "id": args.comparison_run_id,
            "resume": "allow",
        },
        tensorboard_dir=args.output_dir / "logs" / "comparison",
        tables={"runs": (columns, [[row[c] for c in columns] for row in comparison["rows"]])},
        images={"comparison": args.output_dir / "comparison.png"},
        text=table,
    )
    said = []
    if "wandb" in where:
        said.append(f"W&B comparison run {where['wandb'].id} ({wandb_mode()}) in group {comparison['group']}")
    if "tensorboard" in where:
        said.append(f"TensorBoard: {where['tensorboard']}")
    return said


# ----------------------------------------------------------------------------- W&B report
def build_report(comparison: dict, project: str, entity: str | None):
    """A W&B Report of the pair. It opens with the verdict: the comparison's text (comparison.md)
    and the comparison run's table of every arm x seed, its plot and its summary; then the pair's
    runs (filtered on the group, grouped by arm) with loss curves, dev metrics, throughput, peak
    memory and the fp16 loss scale."""
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError:
        raise SystemExit(f"error: {NO_WORKSPACES}") from None
    group = comparison["group"]
    where = {"project": project, **({"entity": entity} if entity else {})}
    verdict_runs = wr.Runset(
        name="comparison", filters=f"Group = '{group}' and JobType = 'comparison'", **where
    )
    runs = wr.Runset(
        name=group,
        filters=f"Group = '{group}' and JobType != 'comparison'",
        groupby=["run.jobType"],
        **where,
    )
    metrics = comparison["metrics"]
    verdict_panels = [
        wr.WeavePanelSummaryTable(table_name="runs"),
        wr.MediaBrowser(title="comparison.png", media_keys=["comparison"]),
        wr.RunComparer(),
    ]
    run_panels = [
        wr.LinePlot(title="training loss", x="Step", y=["loss"]),
        wr.LinePlot(title="dev metrics", x="Step", y=metrics),
        wr.LinePlot(title="fp16 loss scale", x="Step", y=["loss_scale"], log_y=True),
        wr.LinePlot(title="samples/s", x="Step", y=["samples_per_second"]),
        wr.BarPlot(title="peak memory (bytes)", metrics=["peak_memory_bytes"]),
        wr.BarPlot(title="training samples/s", metrics=["train_samples_per_second"]),
        wr.BarPlot(title="final dev metrics", metrics=metrics),
    ]
    text = markdown(comparison, comparison.get("headroom")).split("\n", 1)[1]  # less its title line
    return wr.Report(
        project=project,
        title=f"fp32 vs {', '.join(comparison['arms'][1:])}: {group}",
        description=f"{comparison['recipe']} {shlex.join(comparison['recipe_args'])}",
        blocks=[
            wr.H1(text="Verdict"),
            wr.MarkdownBlock(text=text),
            wr.PanelGrid(runsets=[verdict_runs], panels=verdict_panels),
            wr.H1(text="Runs"),
            wr.PanelGrid(runsets=[runs], panels=run_panels),
        ],
        **({"entity": entity} if entity else {}),
    )


def wandb_report(args, comparison: dict) -> str:
    project = args.recipe_defaults.get("project_name") or "amp-recipes"
    offline = wandb_mode() in ("offline", "disabled")
    entity = args.wandb_entity or ("offline" if offline else None)
    report = build_report(comparison, project, entity)
    if offline:
        return (
            "W&B report built, not saved (W&B is offline): upload the runs with `wandb sync "
            "--sync-all`, then run this command again online with --wandb_report."
        )
    report.save()
    return f"W&B report: {report.url}"


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    check_pair_config(args)
    print(f"Pair group: {args.group} (W&B group of every run; --group to choose another)", flush=True)
    runs = [run_one(args, arm, seed) for seed in args.seeds for arm in args.arms]
    headroom = measure_headroom(args) if args.headroom else None
    comparison = compare(args, runs)
    comparison["headroom"] = headroom
    from amp_recipes.measure import report

    plain = report.json_safe(comparison)  # comparison.json, and what the trackers get: NaN as null
    table = markdown(comparison, headroom)
    report.write(args.output_dir, "comparison", plain, table)
    plot(comparison, args.output_dir / "comparison.png")
    print(table)
    print(f"Wrote {args.output_dir}/comparison.md, comparison.json and comparison.png")
    for line in log_comparison(args, plain, table):
        print(line)
    if args.wandb_report:
        print(wandb_report(args, comparison))
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        print(
            f"error: {len(failed)} run(s) failed; run the same command again to retry them.", file=sys.stderr
        )
        sys.exit(1)
    return comparison


if __name__ == "__main__":
    main()
