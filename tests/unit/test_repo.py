"""The repository's docs and configs match the code."""

import ast
import difflib
import graphlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import RECIPES, REPO, load_recipe

# Each recipe's page in docs/: what it does, its data, its flag table (the shared flags are in bert_glue's).
RECIPE_PAGES = {
    "bert_glue": "docs/recipes/glue.md",
    "bert_mlm": "docs/recipes/mlm.md",
    "bert_ner": "docs/recipes/ner.md",
    "bert_qa": "docs/recipes/qa.md",
}


def recipe_parser_flags(name):
    parser = load_recipe(name).build_parser()
    return {option for action in parser._actions for option in action.option_strings if option != "--help"}


@pytest.mark.parametrize("recipe", ["bert_glue", "bert_mlm", "bert_ner", "bert_qa"])
def test_every_recipe_flag_is_in_its_docs_page(recipe):
    """Each flag is in the recipe's page, or (the shared ones) in bert_glue.py's table."""
    pages = {RECIPE_PAGES[recipe], RECIPE_PAGES["bert_glue"]}
    documented = set(re.findall(r"`(--[a-z0-9_]+)`", "".join((REPO / page).read_text() for page in pages)))
    flags = recipe_parser_flags(recipe)
    assert len(flags) > 20
    missing = flags - documented - {"-h"}
    assert not missing, f"flags of {recipe} missing from {RECIPE_PAGES[recipe]}: {sorted(missing)}"


def documented_defaults(page: str, section_title: str) -> dict[str, str]:
    """{flag: its default as the flag table under `section_title` of docs page `page` writes it}."""
    text = (REPO / page).read_text()
    section = text[text.index(section_title) :]
    table = section[section.index("\n|") : section.index("\n\n", section.index("\n|"))]
    defaults = {}
    for row in table.strip().splitlines()[2:]:
        flags_cell, default_cell = (cell.strip() for cell in row.strip("|").split("|")[:2])
        flags = re.findall(r"`(--[a-z0-9_]+)`", flags_cell)
        inside = re.search(r"\((.*)\)", default_cell)  # "torch's (65536, 2000, 2.0, 0.5)"
        values = (
            (inside.group(1) if inside else default_cell).split(", ") if len(flags) > 1 else [default_cell]
        )
        values = values * len(flags) if len(values) == 1 else values  # one default for all of them
        assert len(values) == len(flags), row
        defaults.update(zip(flags, (value.strip("`") for value in values), strict=True))
    return defaults


@pytest.mark.parametrize(
    "recipe, section",
    [
        ("bert_glue", "## Flags of `recipes/bert_glue.py`"),
        ("bert_mlm", "# Domain-adaptive"),
        ("bert_ner", "## Flags of `recipes/bert_ner.py`"),
        ("bert_qa", "## Flags of `recipes/bert_qa.py`"),
    ],
)
def test_the_docs_give_each_flag_the_parsers_default(recipe, section):
    parser = load_recipe(recipe).build_parser()
    actual = {action.option_strings[0]: action.default for action in parser._actions if action.option_strings}
    unset = {
        "—",
        "off",
        "all",
        "unset",
        "auto",
        "outputs/<task>",
        "outputs/ner",
        "outputs/qa",
        "$GLUE_DIR",
        "2 on CUDA, else 0",
        "main process",
        "accelerate launch's, else 1",
    }
    for flag, written in documented_defaults(RECIPE_PAGES[recipe], section).items():
        default = actual[flag]
        if flag == "--data_dir":
            assert written == "$GLUE_DIR", written  # the parser reads the variable
        elif default is None or default is False:
            assert written in unset, (flag, written)
        elif default is True:  # an on/off flag that is on: --group_by_length (GLUE)
            assert written == "on", (flag, written)
        elif isinstance(default, (int, float)):
            assert float(written) == default, (flag, written, default)
        else:
            assert written == default, (flag, written, default)
    if recipe == "bert_mlm":  # its own defaults for shared flags, written in a sentence
        readme = (REPO / RECIPE_PAGES[recipe]).read_text()
        parsed = vars(load_recipe(recipe).parse_args(["--train_file", "notes.txt"]))
        for flag in ("--learning_rate", "--num_train_epochs", "--output_dir"):
            written = re.search(rf"`{flag} ([^`]+)`", readme[readme.index("Defaults that differ") :]).group(1)
            value = parsed[flag[2:]]
            assert written == value if isinstance(value, str) else float(written) == value, (flag, written)


def precision_lines(path, only_main=False) -> list[str]:
    """The lines `grep -n "AMP:"` lists: the recipe's precision-specific lines (or their comments)."""
    text = path.read_text()
    if only_main:
        text = text[text.index("def main(") : text.index('if __name__ == "__main__":')]
    return [line.strip() for line in text.splitlines() if "# AMP:" in line]


def marked(lines: list[str], fragment: str) -> bool:
    """Whether the line holding `fragment` is marked: itself, by the comment lines right above it, or
    by the line that opens its block or bracket (`if accelerator.sync_gradients:  # AMP: ...`)."""
    index = max(i for i, line in enumerate(lines) if fragment in line)  # the last: main() comes last
    if "# AMP:" in lines[index]:
        return True
    above = index - 1
    while lines[above].strip().startswith("#"):
        if "# AMP:" in lines[above]:
            return True
        above -= 1
    code = lines[above].split("#")[0].rstrip()
    return above == index - 1 and "# AMP:" in lines[above] and code.endswith((":", "[", "("))


PRECISION_CALLS = [
    "resolve_mixed_precision(args.mixed_precision)",  # --mixed_precision auto, resolved in sight
    "mixed_precision=mixed_precision",
    "kwargs_handlers=[",  # GradScalerKwargs
    "*precision.fp8_recipe_kwargs(mixed_precision, args.fp8_backend),",  # torchao / Transformer Engine
    "in_effect = precision.preflight(",
    "precision.check_model_dtype(",
    "accelerator.prepare(",  # autocast and the GradScaler come from here
    "precision.autocast_fsdp2_forward(accelerator, model)",  # FSDP2: autocast, which prepare() leaves out
    "fsdp_plugin=precision.fsdp_plugin(mixed_precision),",  # FSDP2: outputs not cast back to 16 bits
    "in_effect.update(precision.fp8_layer_report(",  # the Linear layers prepare() made fp8
    "torch.no_grad():",  # evaluation: not inference_mode, where fp8 layers fail
    "loss = model(**batch).loss",
    "accelerator.backward(loss)",
    "accelerator.clip_grad_norm_(",
    "optimizer.step()",
    "overflow = run.telemetry.after_optimizer_step()",
    "run.warn_nonfinite(batch, overflow)",  # names a skipped fp16 step's first inf/NaN module
    "run.stop_diverged()",  # fp16: no loss scale helps any more
    "run.stop_if_loss_diverged()",  # bf16/fp32: a non-finite loss ends the run
    "**run.telemetry.read()",
    "**run.activation_ranges()",
    "optim.check_every_parameter_trains(",  # prepare() may swap parameters (fp8): every one still trains
    "return run.save_final_model(tokenizer)",  # the fp32 master weights
]


@pytest.mark.parametrize("recipe", ["bert_glue", "bert_mlm", "bert_ner", "bert_qa"])
def test_every_precision_line_is_marked_for_grep(recipe):
    lines = (RECIPES / f"{recipe}.py").read_text().splitlines()
    calls = [
        *PRECISION_CALLS,
        "dtype=torch.float32",
        {
            "bert_mlm": "= mlm.SeededMaskCollator(",
            "bert_ner": "DataCollatorForTokenClassification(",
            "bert_qa": "collator = DataCollatorWithPadding(",
        }.get(recipe, "make_collator("),
    ]
    unmarked = [call for call in calls if not marked(lines, call)]
    assert not unmarked, f"{recipe}.py: precision lines without '# AMP:': {unmarked}"
    # Written out, not hidden in a helper: the Accelerator call and the GradScaler's settings.
    text = "\n".join(lines)
    assert "accelerator = Accelerator(\n        mixed_precision=mixed_precision," in text
    assert "GradScalerKwargs(\n                init_scale=args.fp16_init_scale," in text


def test_the_recipes_mark_the_same_precision_lines():
    glue = precision_lines(RECIPES / "bert_glue.py", only_main=True)
    assert precision_lines(RECIPES / "bert_ner.py", only_main=True) == glue
    assert precision_lines(RECIPES / "bert_qa.py", only_main=True) == glue
    assert precision_lines(RECIPES / "bert_mlm.py", only_main=True) == glue
    assert len(glue) > 15


# Where each recipe's main() may differ from bert_glue.py's, line for line (indentation and blank
# lines aside): data loading, the model class, the eval loaders, the metric, the evaluate() and
# predict() calls (the masked LM predicts nothing), the run facts. Everything else is the same code in all four: a loop, checkpoint or precision change
# made in one recipe only fails test_the_four_recipes_main_cannot_drift (accelerate's
# tests/test_examples.py guards its examples the same way).
# bert_glue.py's GLUE data, eval loaders, metric and evaluate() call, which every other recipe replaces.
GLUE_LINES = [
    "task, train_dataloader, eval_dataloaders, test_dataloaders = load_data(args, tokenizer, accelerator)",
    "model, optimizer, train_dataloader, lr_scheduler, *eval_loaders = accelerator.prepare(",
    "model, optimizer, train_dataloader, lr_scheduler, *eval_dataloaders.values()",
    "eval_dataloaders = dict(zip(eval_dataloaders, eval_loaders, strict=True))",
    'metric = metrics.load_metric("glue", task.metric_config)  # shipped with amp_recipes: works offline',
    'identity={"task_name": task.name, "label_names": list(task.label_names or [])},',
    "evaluate=lambda: evaluate(model, eval_dataloaders, metric, accelerator, task.is_regression),",
    "predict=lambda: predict(model, test_dataloaders, accelerator, task, args.output_dir),",
]
ONE_EVAL_LOADER = [
    "model, optimizer, train_dataloader, lr_scheduler, eval_dataloader = accelerator.prepare(",
    "model, optimizer, train_dataloader, lr_scheduler, eval_dataloader",
]
MAIN_DIFFERENCES = {  # recipe: (bert_glue.py's lines besides GLUE_LINES, the recipe's lines in their place)
    "bert_ner": (
        ["args.tokenizer_name or args.model_name_or_path, **no_trainer.tokenizer_kwargs(args)"],
        [
            "args.tokenizer_name or args.model_name_or_path,",
            "**ner.tokenizer_kwargs(config),",
            "**no_trainer.tokenizer_kwargs(args),",
            "task, train_dataloader, eval_dataloader, gold, test = load_data(args, tokenizer, accelerator)",
            *ONE_EVAL_LOADER,
            'metric = metrics.load_metric("seqeval")  # shipped with amp_recipes: works offline',
            'identity={"task_name": task.name, "label_names": list(task.label_names)},',
            "evaluate=lambda: evaluate(model, eval_dataloader, metric, accelerator, gold, task.label_names),",
            "predict=lambda: predict(model, test, accelerator, task.label_names, args.output_dir),",
            'facts={"tag_scheme": task.scheme},',
        ],
    ),
    "bert_qa": (
        ["model = load_model(args, config, task)"],
        [
            "task, train_dataloader, eval_dataloader, gold, test = load_data(args, tokenizer, accelerator)",
            "model = load_model(args, config)",
            *ONE_EVAL_LOADER,
            'metric = metrics.load_metric("squad", "v2" if args.version_2_with_negative else "v1")  # works offline',
            'identity={"task_name": task.name, "version_2_with_negative": args.version_2_with_negative},',
            "evaluate=lambda: evaluate(model, eval_dataloader, metric, accelerator, gold, args),",
            "predict=lambda: predict(model, test, accelerator, args),",
        ],
    ),
    "bert_mlm": (
        [  # the MLM model loads its own config (load_model)
            "config = AutoConfig.from_pretrained(",
            "args.config_name or args.model_name_or_path, trust_remote_code=args.trust_remote_code",
            ")",
            "model = load_model(args, config, task)",
        ],
        [
            "train_dataloader, eval_dataloader = load_data(args, tokenizer, accelerator)",
            "model = load_model(args)",
            *ONE_EVAL_LOADER,
            'identity={"objective": "mlm"},',
            "evaluate=lambda: evaluate(model, eval_dataloader, accelerator),",
        ],
    ),
}


def main_lines(recipe: str) -> list[str]:
    text = (RECIPES / f"{recipe}.py").read_text()
    main = text[text.index("def main(") : text.index('if __name__ == "__main__":')]
    return [line.strip() for line in main.splitlines() if line.strip()]


@pytest.mark.parametrize("recipe", list(MAIN_DIFFERENCES))
def test_the_four_recipes_main_cannot_drift(recipe):
    diff = list(difflib.ndiff(main_lines("bert_glue"), main_lines(recipe)))
    removed = [line[2:] for line in diff if line.startswith("- ")]
    added = [line[2:] for line in diff if line.startswith("+ ")]
    glue_lines, declared_added = MAIN_DIFFERENCES[recipe]
    declared_removed = [*GLUE_LINES, *glue_lines]
    assert (sorted(removed), added) == (sorted(declared_removed), declared_added), (
        f"{recipe}.py's main() differs from bert_glue.py's beyond the declared differences: make the "
        "change in all four recipes, or declare it in MAIN_DIFFERENCES.\n"
        + "\n".join(
            line
            for line in diff
            if line.startswith(("- ", "+ "))
            and line[2:] not in (declared_removed if line.startswith("- ") else declared_added)
        )
    )


def test_main_reads_in_five_minutes():
    """The run around the loop lives in amp_recipes.training.run.TrainingRun: main() keeps the lesson and
    the loop's control flow. The caps are for reading, not targets (issue #52): main() <= 130
    lines, the file <= 380; main() <= 140 since issue #63 added two precision lines (FSDP2's
    plugin, and autocast, which accelerate's FSDP2 path leaves out) and issue #64 the
    examples' --config_name and --tokenizer_name; the file <= 420 since issue #64 (the examples'
    flags and data layouts, each a visible line where the recipe reads it), <= 450 since issue #70
    (each recipe defines the examples' flags it takes, and applies --hf_example_defaults,
    --with_tracking and NER's --debug in its own parse_args); main() <= 150 since issue #70 moved
    the run's decisions into it (set_seed, the non-finite loss stop, the epoch's evaluation and
    checkpoint)."""
    for recipe in ("bert_glue", "bert_mlm", "bert_ner", "bert_qa"):
        text = (RECIPES / f"{recipe}.py").read_text()
        main = text[text.index("def main(") : text.index('if __name__ == "__main__":')].rstrip()
        assert len(main.splitlines()) <= 150, recipe
        assert len(text.splitlines()) <= 450, recipe
        assert "with TrainingRun(accelerator, args, in_effect) as run:" in main, recipe


def test_a_step_reads_in_the_recipe_and_two_library_files():
    """Everything the training loop calls of the library (`run.<method>`, `run.telemetry.<...>`,
    `run.meter.<...>`) is defined in amp_recipes/training/run.py or training/telemetry.py, and the
    loop calls no other amp_recipes module: what a step does is read in the recipe and those two
    files (issue #70)."""
    library = REPO / "amp_recipes" / "training"
    defined = {
        node.name
        for name in ("run.py", "telemetry.py")
        for node in ast.walk(ast.parse((library / name).read_text()))
        if isinstance(node, ast.FunctionDef)
    }
    modules = {name.rsplit(".", 1)[-1] for name in library_modules()}
    for recipe in ("bert_glue", "bert_mlm", "bert_ner", "bert_qa"):
        tree = ast.parse((RECIPES / f"{recipe}.py").read_text())
        loop = next(
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.For) and "run.epochs()" in ast.unparse(node.iter)
        )
        called, elsewhere = set(), set()
        for node in ast.walk(loop):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                root = ast.unparse(node.func).split(".")[0]
                if root == "run":
                    called.add(node.func.attr)
                elif root in modules:
                    elsewhere.add(ast.unparse(node.func))
        assert {"count_batch", "after_optimizer_step", "read", "save_checkpoint", "end_epoch"} <= called
        assert called <= defined, f"{recipe}: {sorted(called - defined)} defined elsewhere"
        assert not elsewhere, f"{recipe}'s loop calls {sorted(elsewhere)}"


def test_recipes_open_with_their_command():
    for recipe in RECIPES.glob("[!_]*.py"):
        first_lines = recipe.read_text().split('"""')[1]
        assert f"recipes/{recipe.name}" in first_lines, recipe


@pytest.mark.parametrize("config", sorted((REPO / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load_and_open_with_their_command(config):
    loaded = load_config_from_file(str(config))
    assert loaded.mixed_precision in ("no", "fp16", "bf16")
    assert config.read_text().startswith(
        f"# accelerate launch -q --config_file accelerate_configs/{config.name}"
    )


def test_engine_configs_carry_the_precision_settings_the_readme_promises():
    configs = {p.stem: load_config_from_file(str(p)) for p in (REPO / "accelerate_configs").glob("*.yaml")}
    assert configs["single_gpu"].mixed_precision == configs["multi_gpu"].mixed_precision == "fp16"
    fsdp = configs["fsdp"]
    assert fsdp.distributed_type == "FSDP" and fsdp.mixed_precision == "fp16"
    # FSDP2, parameters resharded after each forward (FSDP1's FULL_SHARD).
    assert fsdp.fsdp_config["fsdp_version"] == 2 and fsdp.fsdp_config["fsdp_reshard_after_forward"] is True
    for stage in (2, 3):
        deepspeed = configs[f"deepspeed_zero{stage}"]
        assert deepspeed.distributed_type == "DEEPSPEED" and deepspeed.mixed_precision == "fp16"
        assert deepspeed.deepspeed_config["zero_stage"] == stage
        assert deepspeed.deepspeed_config["gradient_clipping"] == 1.0  # DeepSpeed clips, not the recipe
    # The model loads whole in fp32 (precision.zero3_init honours the flag); the recipes gather the
    # fp32 masters for the final save, so DeepSpeed's 16-bit gather is off.
    assert configs["deepspeed_zero3"].deepspeed_config["zero3_init_flag"] is False
    assert configs["deepspeed_zero3"].deepspeed_config["zero3_save_16bit_model"] is False
    node = configs["multi_node"]
    assert (node.num_machines, node.num_processes, node.rdzv_backend) == (2, 16, "static")
    page = (REPO / "docs" / "scaling-out.md").read_text()
    assert all(f"`{name}.yaml`" in page for name in configs)


# ----------------------------------------------------------------------------- a clone stands alone
SHARED_REFERENCES = re.compile(r"\.\./shared|[\"']shared[\"']|AMP_SHARED_DIR")


def repository_files() -> list[str]:
    """Tracked files and untracked ones git does not ignore (what a commit would hold)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.splitlines() if (REPO / name).is_file()]


def test_nothing_refers_to_a_folder_beside_the_checkout():
    code = [
        name
        for name in repository_files()
        if name.endswith((".py", ".sh", ".ipynb", ".yaml", ".toml", ".txt", ".cfg")) or name == ".ci/run"
    ]
    code.remove("tests/unit/test_repo.py")  # this file names what it looks for
    offenders = [name for name in code if SHARED_REFERENCES.search((REPO / name).read_text(errors="replace"))]
    assert len(code) > 40 and offenders == []
    # Tests never read $GLUE_DIR: they name the repository's data/glue themselves.
    reads = re.compile(r"environ(\.get)?\(\s*[\"']GLUE_DIR|getenv\(\s*[\"']GLUE_DIR")
    assert [
        name for name in code if name.startswith("tests/") and reads.search((REPO / name).read_text())
    ] == []
    assert "unset GLUE_DIR" in (REPO / ".ci" / "run").read_text()


def test_the_shipped_data_is_what_data_readme_says():
    readme = (REPO / "data" / "README.md").read_text()
    for path in sorted((REPO / "data" / "glue").glob("*/*.tsv")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        assert digest in readme, path
        assert path.stat().st_size < 5 * 2**20, path  # keep the repository lean
    for path in sorted((REPO / "data" / "conll2003").glob("*.txt")):  # research-only: an excerpt
        assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] in readme, path
        assert path.stat().st_size < 200_000, path
    for path in sorted((REPO / "data" / "squad").glob("*.json")):  # CC BY-SA: a sample, attributed
        assert hashlib.sha256(path.read_bytes()).hexdigest()[:16] in readme, path
        assert path.stat().st_size < 300_000, path
    assert len(list((REPO / "data" / "squad").glob("*.json"))) == 2
    vocab = (REPO / "data" / "models" / "bert-base-uncased" / "vocab.txt").read_text().splitlines()
    assert len(vocab) == 30522


def test_a_copy_of_the_checkout_with_nothing_beside_it_reads_its_data(tmp_path):
    """The files a commit holds, copied to a folder with no ../shared and no $GLUE_DIR: the GLUE
    row-count tests and a real recipe run pass there."""
    clone = tmp_path / "alone" / "amp-recipes"
    for name in repository_files():
        target = clone / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    assert not (clone.parent / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("GLUE_DIR", "AMP_SHARED_DIR")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/unit/test_data.py",
            # a real recipe run on the copy's data/glue, in that pytest's process
            "tests/recipes/test_readme_claims.py::test_max_grad_norm_clips_what_the_optimizer_sees_and_0_only_measures",
        ],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\b(\d{2,}) passed\b", result.stdout) and " failed" not in result.stdout


def test_no_library_module_imports_another_modules_private_names():
    """What one module of amp_recipes shares with another is public: no `from amp_recipes.tasks.classification import _x`."""
    import ast

    offenders = []
    for path in sorted((REPO / "amp_recipes").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("amp_recipes")
            ):
                offenders += [
                    f"{path.name}: {alias.name}" for alias in node.names if alias.name.startswith("_")
                ]
    assert not offenders, offenders


def library_modules() -> dict[str, Path]:
    """{dotted name under amp_recipes (`training.run`, `tasks.metrics`): its file}; the shipped
    `evaluate` metric scripts are data, not modules of the library."""
    package = REPO / "amp_recipes"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        if path.parent.parent.name == "metrics" or parts == ("__init__",):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def library_imports() -> dict[str, set[str]]:
    """{module: the amp_recipes modules it imports}, at the top or inside a function, read from the
    source: `from amp_recipes.training import run` imports `training.run`, `from
    amp_recipes.training.run import TrainingRun` too."""
    modules = library_modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{name}: a relative import"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("amp_recipes"):
                base = node.module.removeprefix("amp_recipes").lstrip(".")
                for alias in node.names:
                    module = f"{base}.{alias.name}".lstrip(".")
                    imported.add(module if module in modules else base)
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("amp_recipes.")}
        packages = {name.rsplit(".", 1)[0]} if "." in name else set()  # its own package's docstring
        graph[name] = (imported & set(modules)) - {name} - packages
    return graph


def test_the_library_has_no_import_cycle():
    """No two modules of amp_recipes need each other, not even through an import inside a function:
    each can be read, and moved, after what it imports."""
    graph = library_imports()
    assert graph["cli"] >= {"measure.doctor", "shipped"}  # read, not empty
    assert {"training.checkpoint", "training.outputs"} <= graph["no_trainer"]
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as cycle:
        pytest.fail(f"import cycle: {' -> '.join(cycle.args[1])}")


def test_the_module_map_is_the_tree():
    """recipes/README.md's module map and the API reference name every module of amp_recipes, each
    where it lives, and nothing else; each subpackage's docstring names its modules, and
    pyproject.toml ships every package."""
    modules = library_modules()
    page = (RECIPES / "README.md").read_text()
    table = page.split("| module | holds |", 1)[1].split("\n\n", 1)[0]
    mapped = re.findall(r"^\| `([\w.]+)` \|", table, flags=re.M)
    assert sorted(mapped) == sorted(modules), "recipes/README.md's module map against amp_recipes/"
    # Every package of the tree ships in the wheel (`pip install .`, the Docker image).
    shipped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = {f"amp_recipes.{name}" for name, path in modules.items() if path.name == "__init__.py"}
    assert packages <= set(shipped), sorted(packages - set(shipped))
    documented = re.findall(
        r"^::: amp_recipes\.([\w.]+)$", (REPO / "docs" / "api.md").read_text(), flags=re.M
    )
    assert sorted(documented) == sorted(modules), "docs/api.md against amp_recipes/"
    for package in {name.rsplit(".", 1)[0] for name in modules if "." in name}:
        docstring = ast.get_docstring(ast.parse(modules[package].read_text()))
        members = {name.rsplit(".", 1)[1] for name in modules if name.startswith(f"{package}.")}
        unnamed = [member for member in members if f"`{member}`" not in docstring]
        assert not unnamed, f"amp_recipes/{package}/__init__.py does not name {unnamed}"
