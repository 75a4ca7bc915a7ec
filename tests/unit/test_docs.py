"""The README is a landing page and docs/ holds the rest: what each page says is checked here, and
`mkdocs build --strict` builds the site (a broken link or anchor, or a page outside the nav, fails)."""

import importlib.util
import os
import re
import shlex
import subprocess
import sys

import yaml
from conftest import REPO, missing_tool

DOCS = REPO / "docs"


def nav_pages(entries) -> list[str]:
    """Every page mkdocs.yml's nav lists, in order."""
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def mkdocs_config() -> dict:
    # mkdocs.yml holds no custom YAML tags, so the plain loader reads it.
    return yaml.safe_load((REPO / "mkdocs.yml").read_text())


def test_the_readme_fits_on_two_screens():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)


def test_every_page_is_in_the_nav_once_and_every_nav_entry_exists():
    listed = nav_pages(mkdocs_config()["nav"])
    assert len(listed) == len(set(listed))
    on_disk = sorted(str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk


def test_the_readme_links_to_pages_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert len(targets) >= 15
    missing = [target for target in targets if not (REPO / target).is_file()]
    assert not missing, missing
    # ... and the README's map names every page of the nav.
    assert {f"docs/{page}" for page in nav_pages(mkdocs_config()["nav"]) if page != "index.md"} <= set(
        targets
    )


def test_the_quick_start_is_the_same_command_in_the_readme_and_the_docs():
    readme = (REPO / "README.md").read_text()
    command = readme.split("<!-- quick-start -->")[1].split("<!-- /quick-start -->")[0].strip()
    assert command.startswith("```bash") and command in (DOCS / "getting-started.md").read_text()


def test_the_lines_quoted_as_where_each_call_lives_are_in_the_recipe():
    """docs/mixed-precision.md's table quotes lines of recipes/bert_glue.py: each must be there."""
    page = (DOCS / "mixed-precision.md").read_text()
    table = page.split("## Where each call lives", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")][2:]
    code = {
        line.split("#")[0].strip() for line in (REPO / "recipes" / "bert_glue.py").read_text().splitlines()
    }
    quoted = [re.match(r"\| [^|]+ \| `([^`]+)` \|", row).group(1) for row in rows]
    assert len(quoted) >= 14
    concepts = " ".join(row.split("|")[1] for row in rows)
    for concept in ("autocast", "GradScaler", "fp32 master weights", "Tensor Cores", "bf16", "fp8"):
        assert concept in concepts, concept
    missing = [line for line in quoted if line not in code]
    assert not missing, f"quoted in docs/mixed-precision.md but not a line of recipes/bert_glue.py: {missing}"


def test_the_site_builds_strictly(tmp_path):
    """What CI runs: a broken link or anchor, a page missing from the nav or a docstring
    mkdocstrings cannot render fails the build."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            missing_tool(f"{module} (the [docs] extra)")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("amp_recipes.amp.precision") > 0


# ----------------------------------------------------------------------------- documented commands
DOCUMENTED = [REPO / "README.md", *sorted(DOCS.rglob("*.md")), REPO / "recipes" / "README.md"]
RUNS_A_RECIPE = re.compile(r"(?<![\w/])recipes/(\w+)\.py\s(.*)")
LAUNCHERS = re.compile(r"\b(python|accelerate launch|srun|torchrun)\b")


def shell_words(line: str) -> list[str]:
    """The words a shell makes of `line`: a command substitution `$(...)` (parentheses nested) is one
    word, as its output is; a `# comment` ends the line."""
    out, depth, start = [], 0, None
    for index, char in enumerate(line):
        if line.startswith("$(", index) and depth == 0:
            start = index
        if start is not None:
            depth += char == "("
            depth -= char == ")"
            if depth == 0 and char == ")":
                out.append((start, index + 1))
                start = None
    for begin, end in reversed(out):
        line = line[:begin] + "SUBSTITUTED" + line[end:]
    return shlex.split(line, comments=True)


def documented_recipe_commands() -> list[tuple[str, str, list[str]]]:
    """Every command in a code block of the README, docs/ and recipes/README.md that runs a recipe
    (python, accelerate launch, srun, torchrun): its page, the recipe and the recipe's flags."""
    found = []
    for page in DOCUMENTED:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                match = RUNS_A_RECIPE.search(line)
                if match and LAUNCHERS.search(line):
                    found.append((str(page.relative_to(REPO)), match.group(1), shell_words(match.group(2))))
    return found


def test_every_documented_recipe_command_parses_with_the_recipes_own_parser(capsys):
    """A wrong or renamed flag in any documented command fails here, with the page that shows it."""
    from conftest import load_recipe

    commands = documented_recipe_commands()
    assert len(commands) >= 20 and {recipe for _, recipe, _ in commands} == {
        "bert_glue",
        "bert_ner",
        "bert_qa",
        "bert_mlm",
    }
    failed = []
    for page, recipe, argv in commands:
        try:
            load_recipe(recipe).parse_args(argv)
        except SystemExit:
            failed.append((page, recipe, argv, capsys.readouterr().err.strip().splitlines()[-1:]))
    assert not failed, failed


A_LAUNCH = re.compile(r"(?<![`\w])accelerate launch ")  # a command, not `accelerate launch` in prose


def test_every_documented_accelerate_launch_is_quiet():
    """`accelerate launch -q`: without it, a run that fails prints its error again inside the
    launcher's CalledProcessError traceback (one process) or under torchrun's ChildFailedError
    traceback (several); tests/recipes/test_bad_input.py runs the documented forms. Every command
    in a code block of the docs, in the configs' headers and in the Slurm script carries it."""
    launches = []
    for page in DOCUMENTED:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), re.S):
            launches += [(page.name, line) for line in block.splitlines() if A_LAUNCH.search(line)]
    for path in [*sorted((REPO / "accelerate_configs").glob("*.yaml")), REPO / "scripts" / "launch_slurm.sh"]:
        launches += [(path.name, line) for line in path.read_text().splitlines() if A_LAUNCH.search(line)]
    assert len(launches) >= 25
    assert not [(where, line) for where, line in launches if "accelerate launch -q " not in line]


def test_the_checkpoints_example_checkpoints_before_its_run_ends():
    """docs/checkpoints.md's MRPC examples: --checkpointing_steps falls inside the run (GLUE's
    MRPC train split: 3,668 pairs), so its resume line has a checkpoint to resume; the best
    checkpoint's example evaluates (--eval_steps) often enough for its patience to act."""
    import math

    from conftest import load_recipe

    examples = [argv for page, _, argv in documented_recipe_commands() if page == "docs/checkpoints.md"]
    assert len(examples) == 3 and "--resume_from_checkpoint" in examples[1]
    for argv in examples[:2]:
        args = load_recipe("bert_glue").parse_args(argv)
        steps = math.ceil(3668 / args.per_device_train_batch_size) * args.num_train_epochs
        assert args.task_name == "mrpc" and 0 < int(args.checkpointing_steps) < steps, steps
    args = load_recipe("bert_glue").parse_args(examples[2])
    steps = math.ceil(3668 / args.per_device_train_batch_size) * args.num_train_epochs
    assert args.load_best_model_at_end and args.eval_steps * (args.early_stopping_patience + 1) < steps
