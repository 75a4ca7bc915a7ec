"""The flags of transformers' accelerate examples, read from their source, against the recipes' table.

    python scripts/no_trainer_flags.py path/to/transformers/examples/pytorch            # the table's gaps
    python scripts/no_trainer_flags.py path/to/transformers/examples/pytorch --write    # a new snapshot

Reads the four `run_*_no_trainer.py` scripts the recipes stand in for (their `parse_args`'
`add_argument` calls, by their syntax: nothing of them is imported or run) and lists every flag
that amp_recipes.migration.FLAGS does not account for, and every flag the table holds that the
scripts no longer have: what a newer transformers release adds is named, never silently missed.
`--write` stores what it read in tests/data/no_trainer/flags.json (the snapshot the test suite
checks the recipes' parsers against), with the commit it came from when given (`--commit`).
Exit code 1 when the table has a gap.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # amp_recipes without `pip install -e .`

SNAPSHOT = REPO / "tests" / "data" / "no_trainer" / "flags.json"


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
    from amp_recipes.migration import EXAMPLES

    return {name: example_flags(examples / path) for name, path in EXAMPLES.items()}


def gaps(read: dict[str, dict]) -> list[str]:
    """Sentences naming what the table does not account for, or holds for a flag that is gone."""
    from amp_recipes.migration import FLAGS

    found = []
    for example, flags in read.items():
        for flag in flags:
            if flag not in FLAGS or example not in FLAGS[flag].examples:
                found.append(f"{example}: {flag} is not in amp_recipes.migration.FLAGS")
    for flag, row in FLAGS.items():
        for example in row.examples:
            if flag not in read.get(example, {}):
                found.append(f"{example}: the table lists {flag}, which the script no longer has")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", type=Path, help="transformers' examples/pytorch folder.")
    parser.add_argument("--write", action="store_true", help=f"Store the flags read in {SNAPSHOT}.")
    parser.add_argument("--commit", help="The transformers commit the folder is at (recorded with --write).")
    args = parser.parse_args(argv)
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
        print(f"Every flag of the {len(read)} examples is in amp_recipes.migration.FLAGS.")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
