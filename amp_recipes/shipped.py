"""The recipes shipped with the package (the repository's recipes/ folder, installed as
amp_recipes.recipes): what `amp-recipes ls` lists and `amp-recipes cp` copies, and how the doctor
and paired_runs find the recipe they are given, by its name or by the path of your copy."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

from amp_recipes.errors import InputError

TIERS = {  # name prefix -> what the tier is (the repository's recipes/ and recipes/minimal/)
    "": "full recipes: accelerate runs AMP, one GPU to many nodes, checkpoints and resume, telemetry",
    "minimal/": "minimal tier: one device, plain PyTorch, every AMP call written out; to learn or port",
}


def recipes() -> dict[str, Path]:
    """{name: file} of the recipes shipped with the package: `bert_glue`, ..., `minimal/bert_glue`."""
    found = {}
    for prefix in TIERS:
        folder = resources.files("amp_recipes.recipes").joinpath(prefix or ".")
        for entry in folder.iterdir():
            if entry.name.endswith(".py") and not entry.name.startswith("_"):
                found[prefix + Path(entry.name).stem] = Path(str(entry))
    return found


def recipe_file(recipe: str) -> Path:
    """A shipped recipe's file by its name (`bert_glue`), or your copy's by its path (a .py file)."""
    path = Path(recipe)
    if path.suffix == ".py":
        if not path.is_file():
            raise InputError(f"--recipe {recipe}: no such file.")
        return path.resolve()
    shipped = recipes()
    if recipe not in shipped:
        raise InputError(
            f"--recipe {recipe!r}: choose from {', '.join(sorted(shipped))}, or give your copy's path (a .py file)."
        )
    return shipped[recipe]


def load(recipe: str):
    """The recipe (by name or path) as a module, its `main()` not run."""
    path = recipe_file(recipe)
    spec = importlib.util.spec_from_file_location(f"amp_recipes_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
