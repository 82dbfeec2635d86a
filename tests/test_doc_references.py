"""Every place the code and the docs cite a section of BENCHMARKS.md, RESULTS.md or csrc/README.md, or a
record folder, names one that exists: a reader who follows the citation finds what it points to."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CITED_DOCS = ("BENCHMARKS.md", "RESULTS.md", "csrc/README.md")
# `BENCHMARKS.md, "Section title"` (the title may wrap onto the next line)
SECTION_CITATION = re.compile(r"(BENCHMARKS\.md|RESULTS\.md|csrc/README\.md),\s+\"([^\"]+)\"")
# a bare word after the document name is a section title without its quotes (e.g. `BENCHMARKS.md, Target 1`)
UNQUOTED_CITATION = re.compile(r"BENCHMARKS\.md, (?!\")([A-Z][A-Za-z0-9 ]*)[)\".,]")
RECORD_CITATION = re.compile(r"`+((?:h100|h200|cpu)(?:x\d)?-20\d\d-\d\d-\d\d-[a-z0-9-]+)`+")


def _sources() -> list[Path]:
    skip = {"records", ".git", "build", "runs", Path(__file__).name}
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if rel.parts and (rel.parts[0] in skip or rel.parts[0].startswith(".") or path.name in skip) or not path.is_file():
            continue
        if path.suffix in (".py", ".md", ".sh", ".yaml", ".cpp", ".cu", ".h"):
            files.append(path)
    return files


def _titles(doc: str) -> set[str]:
    """Headings and bold leads (``**Title**``) of ``doc``, whitespace collapsed."""
    text = (ROOT / doc).read_text()
    titles = {m.group(1) for m in re.finditer(r"^#+\s+(.*?)\s*$", text, re.M)}
    titles |= {m.group(1) for m in re.finditer(r"\*\*([^*]+)\*\*", text)}
    return {" ".join(t.split()) for t in titles}


def _cites(pattern: re.Pattern) -> list[tuple[str, re.Match]]:
    return [(str(path.relative_to(ROOT)), m) for path in _sources() for m in pattern.finditer(path.read_text())]


def test_cited_sections_exist():
    titles = {doc: _titles(doc) for doc in CITED_DOCS}
    missing = []
    for where, m in _cites(SECTION_CITATION):
        title = " ".join(m.group(2).split())
        if not any(t == title or t.startswith(title) for t in titles[m.group(1)]):
            missing.append(f"{where}: {m.group(1)}, \"{title}\"")
    assert not missing, "cited sections that do not exist:\n" + "\n".join(missing)


def test_section_citations_are_quoted():
    bare = [f"{where}: {m.group(0)}" for where, m in _cites(UNQUOTED_CITATION)]
    assert not bare, "cite a section by its quoted title:\n" + "\n".join(bare)


def test_cited_record_folders_exist():
    folders = {p.name for kind in ("benchmarks", "experiments") for p in (ROOT / "records" / kind).iterdir()}
    missing = sorted({f"{where}: {m.group(1)}" for where, m in _cites(RECORD_CITATION) if m.group(1) not in folders})
    assert not missing, "cited record folders that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, ok", [('(BENCHMARKS.md, "Attention backends")', True),
                                      ('(BENCHMARKS.md, "Fusion in the\nbranches")', False)])
def test_the_check_sees_a_wrapped_title(text, ok):
    m = SECTION_CITATION.search(text)
    title = " ".join(m.group(2).split())
    assert any(t.startswith(title) for t in _titles("BENCHMARKS.md")) is ok
