"""The manual: `mkdocs build --strict` passes (a broken link or anchor fails it), the generated references list
every command-line option and every policy field, and the README stays a short front door."""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evomerge import cli, policy

ROOT = Path(__file__).resolve().parent.parent
DOCS_PACKAGES = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings_handlers.python": "mkdocstrings-python"}


commands = cli.commands  # the walker the reference page is built with


def _missing_packages() -> list[str]:
    missing = []
    for module, package in DOCS_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(package)
    return missing


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    missing = _missing_packages()
    assert not missing, (f"the docs build needs {', '.join(missing)}, which is not installed in {sys.prefix}: "
                         f"pip install -e '.[docs]' (bash scripts/setup.sh --test installs it with the test extra)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    return out


def _sections(page: Path) -> dict[str, str]:
    """The page's h2 sections by their heading text (tags and the permalink sign stripped)."""
    text = page.read_text(encoding="utf-8")
    out = {}
    for chunk in re.split(r"(?=<h2 )", text)[1:]:
        head = re.match(r"<h2[^>]*>(.*?)</h2>", chunk, re.S)
        title = html.unescape(re.sub(r"<[^>]+>", "", head.group(1))).replace("¶", "").strip()
        out[title] = chunk
    return out


@pytest.mark.system
def test_the_site_builds_strictly_with_every_page(site):
    for page in ("index", "concepts", "studies", "time", "policies", "running", "searching", "reviewing",
                 "own-model", "scaling", "deploy", "calibrate", "api", "development", "results", "reference/cli",
                 "reference/policy"):
        assert (site / page / "index.html").is_file() or page == "index", page
    assert (site / "index.html").is_file()
    assert not (site / "hooks").exists(), "the build's hook files are published"
    assert not (ROOT / "docs" / "reference").exists(), "the references are generated at build time, not committed"
    results = (site / "results" / "index.html").read_text(encoding="utf-8")
    assert "compare_samplers.py" in results and "2-core" in results  # benchmarks/RESULTS.md, in the site
    # the pages link the generated pages' sources on disk; in the site those links are the generated pages
    front = (site / "index.html").read_text(encoding="utf-8")
    for page in ("reference/policy/", "reference/cli/", "results/"):
        assert f'href="{page}"' in front, page
    assert "evomerge/cli.py" not in front and "RESULTS.md" not in front


def test_every_link_of_the_manual_works_on_disk():
    """A reader of docs/ on disk or on a code host follows the same links as the site's (which the hook repoints)."""
    broken = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not target.startswith("mailto:") and not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, f"links to nothing on disk: {broken}"


def test_the_studies_page_names_every_shipped_policy():
    """(snoo was shipped and missing from the list of named policies.)"""
    text = (ROOT / "docs" / "studies.md").read_text(encoding="utf-8")
    listed = text.split("then among the shipped", 1)[1].split("so a study file", 1)[0]
    shipped = sorted(p.stem for p in (ROOT / "studies" / "policies").glob("*.json"))
    assert sorted(re.findall(r"`([a-z-]+)`", listed)) == shipped


@pytest.mark.system
def test_the_cli_reference_lists_every_command_and_option(site):
    sections = _sections(site / "reference" / "cli" / "index.html")
    seen = 0
    for path, parser in commands(cli.build_parser()):
        title = f"evomerge {' '.join(path)}"
        assert title in sections, f"{title}: no section in the CLI reference"
        body = sections[title]
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            for name in a.option_strings or [a.dest]:
                assert f"<code>{html.escape(name)}</code>" in body, f"{title} {name}: not in the CLI reference"
                seen += 1
            if a.help and "(default: " in a.help:  # the stated default is shown
                stated = a.help[a.help.rindex("(default: ") + 10:].rstrip(")")
                assert html.escape(stated.split()[0]) in body, f"{title} {a.option_strings}: default not shown"
    assert seen > 60


@pytest.mark.system
def test_the_policy_reference_lists_every_field(site):
    page = (site / "reference" / "policy" / "index.html").read_text(encoding="utf-8")
    since = {f: v for v, fields in policy.ADDED_IN.items() for f in fields}
    for name in policy.MergePolicy.__pydantic_fields__:
        assert f'id="{name}"' in page, f"policy field {name}: no entry in the policy reference"
        entry = page[page.index(f'id="{name}"'):]
        assert f"schema {since.get(name, 1)}." in re.sub(r"<[^>]+>", "", entry[:2000]), name
    assert f"schema version {policy.SCHEMA_VERSION}" in page


@pytest.mark.system
def test_the_api_page_documents_the_entry_points(site):
    page = (site / "api" / "index.html").read_text(encoding="utf-8")
    for obj in ("evomerge.search", "evomerge.run", "evomerge.runtime.Merger", "evomerge.policy.MergePolicy",
                "evomerge.study.Study"):
        assert f'id="{obj}"' in page, obj
    search = page[page.index('id="evomerge.search"'):page.index('id="evomerge.run"')]
    assert "warm_start_from" in search, "evomerge.search is documented as the subpackage, not the function"
    assert ":class:" not in page


def test_the_readme_is_a_short_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines; at most 200"
    quick = "EVOMERGE_DATA_DIR=../shared/data .venv/bin/evomerge search --study mnist-gossip"
    assert f"bash scripts/setup.sh && {quick}" in text
    assert 'bash scripts/setup.sh --test && .venv/bin/python -m pytest -q -m "unit or integration or system"' in text
    outside = [m.group(0) for m in re.finditer(r"\.\./[\w./-]*", text) if m.group(0) != "../shared/data"]
    assert not outside, f"README.md names paths outside the repository: {outside}"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links {target}, which does not exist"
