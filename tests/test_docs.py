"""The documents' cross-references hold: every relative link in the README and docs/ reaches its file and heading,
and every section of docs/results.md or docs/results-history.md that code or docs name (the file's name, then
the section's title in double quotes) is a heading of that file. Sections move between the two files as tables are
replaced; a reference left behind fails here instead of sending a reader to nothing."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SOURCES = [p for folder in ("coordinator", "edge_client", "edgefil", "firmware_sim", "models", "benchmarks", "tests")
           for p in sorted((ROOT / folder).rglob("*.py"))]
RESULTS_FILES = ("results.md", "results-history.md")


def headings(markdown: str) -> list[str]:
    """The heading titles of `markdown`, outside code fences."""
    titles, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            titles.append(m.group(1))
    return titles


def anchors(markdown: str) -> set[str]:
    """The link targets GitHub gives `markdown`'s headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated title numbered from -1."""
    seen: dict[str, int] = {}
    found = set()
    for title in headings(markdown):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"^[a-z]+:", target):  # a web address: not this repository's to check
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path) if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_every_results_section_named_in_quotes_is_a_heading_of_that_file():
    titles = {name: headings((ROOT / "docs" / name).read_text()) for name in RESULTS_FILES}
    named, missing = 0, []
    for source in DOCS + SOURCES:
        # a title may wrap over lines, in a comment or a docstring: the lines joined, their indent and "#" dropped
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", source.read_text())
        for name, title in re.findall(r"(results(?:-history)?\.md)[,:]?\s+\(?\"([^\"]+)\"", text):
            named += 1
            if not any(h.startswith(title) for h in titles[name]):
                missing.append(f"{source.relative_to(ROOT)}: {name}, \"{title}\"")
    assert named > 10  # the pattern still finds the references it is here for
    assert not missing, missing
