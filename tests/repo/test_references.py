"""Every reference in the code, tests and docs leads to a file of the project.

A citation names a file that exists (``docs/design.md "ES, precisely" 4``, ``es_ray/strategy.py``), a cited section
exists in that page, and nothing points at a design document outside the project or at a README section that
moved to docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

from paths import REPO as ROOT

SOURCES = ("es_ray", "grpo", "launch", "tests", "scripts", "benchmarks", "docs", "conf", "docker")
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\b(?!\w)|DESIGN\.md|STYLE\.md|the README's \w+ section")
# A cited file: a project folder, a path, an extension. Quoted literals are data the code reads (and fails on if
# missing), and metric names such as grpo/kl have no extension.
CITED_PATH = re.compile(
    r"(?<![\w/.\"'])((?:docs|es_ray|grpo|launch|tests|scripts|benchmarks|conf|docker)/[\w./-]*"
    r"\.(?:py|md|yaml|sh|txt|json|toml))\b"
)
CITED_SECTION = re.compile(r'docs/(design\.md) "([^"]+)"')


def project_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SOURCES:
        files += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".sh", ""} and "__pycache__" not in p.parts
        ]
    return sorted(files)


def _lines(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    return list(enumerate(text.splitlines(), 1))


def test_nothing_cites_a_document_outside_the_project():
    this = Path(__file__).resolve()
    bad = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for p in project_files()
        if p.resolve() != this
        for n, line in _lines(p)
        if OUTSIDE.search(line)
    ]
    assert not bad, "references outside the project (cite docs/design.md or the docs page):\n" + "\n".join(bad)


def test_every_cited_project_path_exists():
    missing = []
    for p in project_files():
        for n, line in _lines(p):
            for cited in CITED_PATH.findall(line):
                if not (ROOT / cited).exists():
                    missing.append(f"{p.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "cited paths that are not in the project:\n" + "\n".join(missing)


def test_every_cited_design_section_exists():
    headings = {m.group(1) for m in re.finditer(r"^## (.+)$", (ROOT / "docs/design.md").read_text(), re.M)}
    cited = {
        (f"{p.relative_to(ROOT)}:{n}", m.group(2))
        for p in project_files()
        for n, line in _lines(p)
        for m in CITED_SECTION.finditer(line)
    }
    assert cited, "nothing cites docs/design.md: the check would pass vacuously"
    assert all(section in headings for _, section in cited), sorted(c for c in cited if c[1] not in headings)
