"""The README is a landing page and docs/ holds the rest: what each page says is checked here, and
`mkdocs build --strict` builds the site (a broken link or anchor, or a page outside the nav, fails)."""

import importlib.util
import os
import re
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
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("amp_recipes.precision") > 0
