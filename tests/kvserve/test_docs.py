"""The docs stand alone: every file or section they (and the code's comments)
cite is in this repository, and none points at design notes, issues or
folders outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PACKAGES = ("benchmarks", "connectors", "decode_svc", "engine", "kvserve", "kvstore", "native",
            "prefill_svc", "proto", "router", "scripts", "security", "studies", "telemetry",
            "k8s", "tests")
CODE = sorted(p for pkg in PACKAGES for ext in ("*.py", "*.proto", "*.c", "*.sh")
              for p in (ROOT / pkg).rglob(ext))

# Citations of things that are not in the repository.
OUTSIDE = re.compile(r"DESIGN §|INTERFACES §|/work/|\.\./shared|[Mm]ust[- ]show")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"\b(docs/[\w.-]+\.md)(#[\w-]+)?")
TOP = "|".join(("docs", *PACKAGES))
PATH = re.compile(rf"`((?:{TOP})/[\w./-]+\.\w+)`")


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(md: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", md.read_text(), re.M)}


def _missing(target: str, base: Path) -> str | None:
    """Why a link target from a file in ``base`` does not resolve, or None."""
    path, _, anchor = target.partition("#")
    dest = (base / path).resolve() if path else None
    if dest is not None and not dest.exists():
        return f"{target}: no such file"
    md = dest or None
    if anchor and md is not None and md.suffix == ".md" and anchor not in _anchors(md):
        return f"{target}: no heading #{anchor} in {md.name}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_only_what_the_repository_holds(doc: Path) -> None:
    text = doc.read_text()
    problems = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
                for m in OUTSIDE.finditer(text)]
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):          # http(s)://, mailto:
            continue
        if target.startswith("#"):
            if target[1:] not in _anchors(doc):
                problems.append(f"{target}: no such heading here")
            continue
        why = _missing(target, doc.parent)
        if why:
            problems.append(why)
    for m in PATH.finditer(text):
        if not (ROOT / m.group(1)).exists():
            problems.append(f"`{m.group(1)}`: no such file in the repository")
    assert not problems, "\n".join(problems)


def test_code_comments_cite_docs_that_exist() -> None:
    problems = []
    for path in CODE:
        if path.name == "test_docs.py":
            continue
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        problems += [f"{rel}: {m.group(0)!r}" for m in re.finditer(
            r"DESIGN §|INTERFACES §|[Mm]ust[- ]show", text)]
        for m in CODE_REF.finditer(text):
            why = _missing(m.group(1) + (m.group(2) or ""), ROOT)
            if why:
                problems.append(f"{rel}: {why}")
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_dangling_citation(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Title\n")
    assert _missing("nowhere.md", tmp_path) == "nowhere.md: no such file"
    assert _missing("x.md#title", tmp_path) is None
    assert _missing("x.md#other", tmp_path) is not None
    assert OUTSIDE.search("see DESIGN §3") and OUTSIDE.search("/work/shared/traces")
    assert _slug("Tiers, TTLs and eviction") == "tiers-ttls-and-eviction"
