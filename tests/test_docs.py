"""The documentation: every relative link resolves (files and headings), every page is reachable from
the README, the README stays short, its Python example runs, and the configuration reference
matches the config models."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from configs import docs
from tests.scripts import linked_home, run_script

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page, code blocks left out."""
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links that do not resolve: {broken}"


def test_every_page_is_linked_from_the_readme_or_the_results_index():
    def linked(page: Path) -> set[Path]:
        return {(page.parent / target.partition("#")[0]).resolve() for target in links(page)}

    reachable = linked(REPO / "README.md") | linked(REPO / "docs" / "results" / "README.md")
    assert [str(page.relative_to(REPO)) for page in PAGES[1:] if page not in reachable] == []


def test_the_readme_fits_on_a_few_screens():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_configuration_reference_is_what_the_config_models_say():
    assert docs.PAGE.read_text() == docs.page(), "docs/configuration.md is stale: run python -m configs.docs"


@pytest.mark.slow
def test_the_readmes_python_example_runs(tmp_path, smollm2_dir):
    """The quickstart's Python block, as a user pastes it (its prompt cache in a fresh home)."""
    readme = (REPO / "README.md").read_text()
    [example] = re.findall(r"^```python\n(from cascade import LLM.*?)^```", readme, re.M | re.S)
    home = linked_home(tmp_path / "home")
    result = run_script([sys.executable, "-c", example], env={**os.environ, "CASCADE_HOME": str(home)})
    answer, _, streamed = result.stdout.partition(" tokens/s\n")
    assert re.search(r"\S.* (stop|length) \d+\.\d$", answer, re.S) and streamed.strip(), result.stdout
    assert list((home / "prompt-cache").glob("*.safetensors")), "the example's prompts were not stored"
