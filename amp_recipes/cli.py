"""`amp-recipes`: list the recipes and copy one to start your own job.

    amp-recipes ls
    amp-recipes cp bert_glue ./my_task.py          # --force to overwrite
    amp-recipes cp minimal/bert_glue ./my_loop.py  # the minimal tier: AMP by hand, one device
    amp-recipes doctor --recipe bert_glue -- --task_name mrpc ...  # which precision and batch, from your data

Two tiers: the full recipes (accelerate: one GPU to many nodes, checkpoints, telemetry) and the
minimal tier (the textbook loop in plain PyTorch, every autocast and GradScaler call written out).

A copied recipe is a plain script: it imports this package (installed) and nothing from the
repository, so it runs from any directory.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
import time
from pathlib import Path

from amp_recipes.shipped import TIERS, recipes


def describe(path: Path) -> tuple[str, str]:
    """(one line on what the recipe does, its launch command), from the recipe's docstring."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [line.strip() for line in docstring.splitlines()]
    command = next((line for line in lines if line.startswith(("accelerate launch", "python "))), "")
    return (lines[0] if lines else ""), command


# The command's start: the console script imports this module first (the package imports nothing
# heavy), so torch's and the libraries' imports come after it and count in the doctor's --budget_s.
IMPORTED = time.monotonic()


def command() -> int:
    """The `amp-recipes` command: the doctor's --budget_s counts from the command's start (this
    module's import), so the imports count too."""
    return main(sys.argv[1:], IMPORTED)


def main(argv=None, started: float | None = None) -> int:
    """`started`: the time.monotonic() the doctor's --budget_s counts from (default: its call)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # its own flags, then the recipe's after `--` (amp_recipes.measure.doctor)
        from amp_recipes.errors import one_sentence_errors
        from amp_recipes.measure.doctor import main as doctor

        with one_sentence_errors():
            doctor(argv[1:], started)
        return 0
    parser = argparse.ArgumentParser(prog="amp-recipes", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("ls", help="List the recipes, what each does and how to launch it.")
    copy = commands.add_parser("cp", help="Copy a recipe to start your own job.")
    copy.add_argument("recipe", help="Recipe name, e.g. bert_glue (see `amp-recipes ls`).")
    copy.add_argument("destination", help="File (or folder) to copy it to.")
    copy.add_argument("--force", action="store_true", help="Overwrite an existing file.")
    commands.add_parser(
        "doctor",
        help="Which precision and batch: fp16 risks, speed, memory and the largest batch, read from your model and data.",
    )
    args = parser.parse_args(argv)

    available = recipes()
    if args.command == "ls":
        width = max(map(len, available))
        for prefix, tier in TIERS.items():
            print(f"# {tier}")
            for name, path in sorted(available.items()):
                if name.startswith(prefix) and "/" not in name.removeprefix(prefix):
                    description, command = describe(path)
                    print(f"{name:<{width}}  {description}\n{'':<{width}}  {command}")
        return 0

    name = args.recipe.removesuffix(".py")
    if name not in available:
        parser.error(f"no recipe {args.recipe!r}; choose from {', '.join(sorted(available))}.")
    destination = Path(args.destination)
    if destination.is_dir():
        destination = destination / f"{Path(name).name}.py"
    if destination.exists() and not args.force:
        print(f"amp-recipes: {destination} exists; pass --force to overwrite it.", file=sys.stderr)
        return 1
    destination.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(available[name], destination)
    _, command = describe(available[name])
    next_command = command.replace(f"recipes/{name}.py", str(destination)) or f"python {destination} --help"
    print(f"Copied {name} to {destination}. Edit it, then run:\n  {next_command}")
    return 0


if __name__ == "__main__":
    sys.exit(command())
