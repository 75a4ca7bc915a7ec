"""The flags of transformers' accelerate examples, read from their source, against the recipes' parsers.

    python scripts/no_trainer_flags.py path/to/transformers/examples/pytorch            # the recipes' gaps
    python scripts/no_trainer_flags.py path/to/transformers/examples/pytorch --write    # a new snapshot
    python scripts/no_trainer_flags.py --docs       # docs/migrating.md's table, from the recipes' parsers

Reads the four `run_*_no_trainer.py` scripts the recipes stand in for (their `parse_args`'
`add_argument` calls, by their syntax: nothing of them is imported or run) and names every flag a
recipe's parser does not take: what a newer transformers release adds is named, never silently
missed. `--write` stores what it read in tests/data/no_trainer/flags.json (the snapshot the test
suite checks the recipes' parsers against), with the commit it came from when given (`--commit`).
`--docs` writes docs/migrating.md's table of every example flag and what each recipe does with it,
from the recipes' own parsers (their option strings, defaults and help) and the snapshot; a test
keeps the page equal to it. Exit code 1 when a recipe lacks a flag.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # amp_recipes without `pip install -e .`

SNAPSHOT = REPO / "tests" / "data" / "no_trainer" / "flags.json"
PAGE = REPO / "docs" / "migrating.md"
# The example each recipe stands in for, under transformers' examples/pytorch.
EXAMPLES = {
    "bert_glue": "text-classification/run_glue_no_trainer.py",
    "bert_ner": "token-classification/run_ner_no_trainer.py",
    "bert_qa": "question-answering/run_qa_no_trainer.py",
    "bert_mlm": "language-modeling/run_mlm_no_trainer.py",
}


def example_flags(script: Path) -> dict[str, dict]:
    """{flag: its add_argument keywords as written (type, default, action, choices, ...)} of the
    script's parse_args(), in declaration order."""
    source = script.read_text()
    flags = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "parse_args"):
            continue
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
                keywords = {
                    kw.arg: ast.get_source_segment(source, kw.value)
                    for kw in call.keywords
                    if kw.arg != "help"
                }
                flags[call.args[0].value] = {"line": call.lineno, **keywords}
    return dict(sorted(flags.items(), key=lambda item: item[1]["line"]))


def read_examples(examples: Path) -> dict[str, dict]:
    return {name: example_flags(examples / path) for name, path in EXAMPLES.items()}


def recipe_parser(recipe: str) -> argparse.ArgumentParser:
    """The recipe's own parser (recipes/<recipe>.py's build_parser)."""
    spec = importlib.util.spec_from_file_location(f"_flags_{recipe}", REPO / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def gaps(read: dict[str, dict]) -> list[str]:
    """A sentence for each flag of an example that its recipe's parser does not take."""
    found = []
    for recipe, flags in read.items():
        taken = recipe_parser(recipe)._option_string_actions
        found += [
            f"{recipe}: {flag} of its example is not a flag of the recipe"
            for flag in flags
            if flag not in taken
        ]
    return found


def _default(value) -> str:
    """A recipe's default as the table writes it."""
    if value is None or isinstance(value, bool):
        return {None: "none", False: "off", True: "on"}[value]
    return str(value)


def _their_default(spec: dict) -> str:
    """The example's default, from its add_argument keywords as written."""
    if "action" in spec:
        return "off"
    if spec.get("required") == "True":
        return "required"
    written = spec.get("default", "None").strip('"')
    return {"None": "none", "False": "off", "True": "on"}.get(written, written)


def _cell(by_recipe: dict[str, str]) -> str:
    """One text for every recipe, or each recipe's (`glue: ...; mlm: ...`) where they differ."""
    texts = list(dict.fromkeys(by_recipe.values()))
    if len(texts) == 1:
        return texts[0]
    return "<br>".join(
        f"**{', '.join(r for r, t in by_recipe.items() if t == text)}**: {text}" for text in texts
    )


def table(read: dict[str, dict]) -> str:
    """Every flag of the examples (in their order) and what each recipe's parser does with it:
    the recipe's own flag of that name (same), another name of one of its flags (alias), or a
    flag it refuses in one sentence (refused); its default beside the example's; its help."""
    parsers = {recipe: recipe_parser(recipe) for recipe in read}
    short = {recipe: parser.get_default("example") for recipe, parser in parsers.items()}
    flags: dict[str, list[str]] = {}
    for recipe, example in read.items():
        for flag in example:
            flags.setdefault(flag, []).append(recipe)
    lines = [
        "| flag | examples | here | default here (the example's) | what it does in the recipes |",
        "|---|---|---|---|---|",
    ]
    for flag, recipes in flags.items():
        actions = {short[r]: parsers[r]._option_string_actions[flag] for r in recipes}
        how = {
            r: "refused"
            if (a.help or "").startswith("Refused")
            else ("same" if a.option_strings[0] == flag else f"alias of `{a.option_strings[0]}`")
            for r, a in actions.items()
        }
        theirs = {short[r]: _their_default(read[r][flag]) for r in recipes}
        default = _cell({r: f"{_default(a.default)} ({theirs[r]})" for r, a in actions.items()})
        what = _cell({r: (a.help or "").replace("|", "\\|").replace("<", "&lt;") for r, a in actions.items()})
        lines.append(f"| `{flag}` | {', '.join(actions)} | {_cell(how)} | {default} | {what} |")
    return "\n".join(lines)


def write_docs(read: dict[str, dict]) -> None:
    """docs/migrating.md's table, between its `<!-- flags -->` markers, made anew."""
    page = PAGE.read_text()
    new = re.sub(
        r"(<!-- flags -->\n).*?(<!-- /flags -->)",
        lambda m: m[1] + table(read) + "\n" + m[2],
        page,
        flags=re.S,
    )
    PAGE.write_text(new)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, nargs="?", help="transformers' examples/pytorch folder.")
    parser.add_argument("--write", action="store_true", help=f"Store the flags read in {SNAPSHOT}.")
    parser.add_argument("--commit", help="The transformers commit the folder is at (recorded with --write).")
    parser.add_argument(
        "--docs",
        action="store_true",
        help=f"Write the table of {PAGE} (from the examples read, else the snapshot).",
    )
    args = parser.parse_args(argv)
    if args.examples is None:
        if not args.docs or args.write:
            parser.error("give the examples' folder (--write stores what is read from it), or --docs alone.")
        read = json.loads(SNAPSHOT.read_text())["examples"]
    else:
        read = read_examples(args.examples)
    if args.write:
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(
            json.dumps({"transformers_commit": args.commit, "examples": read}, indent=2) + "\n"
        )
        print(f"Wrote {SNAPSHOT}")
    found = gaps(read)
    for sentence in found:
        print(sentence)
    if not found:
        print(f"Every flag of the {len(read)} examples is a flag of its recipe.")
    if args.docs and not found:
        write_docs(read)
        print(f"Wrote the table of {PAGE}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
