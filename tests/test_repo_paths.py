"""Every repository path the product names exists: in the README, docs/, every command's --help,
and the strings (error messages, docstrings) of kvexport/ and backends/."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a path under one of the repository's top-level folders, or a bare Markdown file name
_REPO_PATH = re.compile(r"(?<![\w./\-$~])((?:docs|examples|backends|kvexport|tests|\.ci)/[\w./\-]*[\w/])")
_MD_NAME = re.compile(r"(?<![\w./\-])([\w\-]+\.md)\b")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PLACEHOLDER = re.compile(r"(?:^|/)[A-Z][A-Z_]*(?:/|$)|_[A-Z]{2,}\b")  # backends/NAME/kvexport_NAME/


def missing_paths(text: str, base: Path | None = None) -> list[str]:
    """Repository paths named in `text` that do not exist. `base` is the folder relative links and
    bare `*.md` names may be relative to (a Markdown file's own folder)."""
    bases = [ROOT, ROOT / "docs", *([base] if base else [])]
    missing: list[str] = []
    for path in _REPO_PATH.findall(text):
        path = path.rstrip(".")
        if _PLACEHOLDER.search(path):
            continue
        if not any((b / path).exists() for b in bases):
            missing.append(path)
    for name in _MD_NAME.findall(text):
        if not any((b / name).exists() for b in bases):
            missing.append(name)
    for link in _MD_LINK.findall(text):
        target = link.split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue  # an anchor in the same page, or a URL
        if not ((base or ROOT) / target).exists():
            missing.append(link)
    return sorted(set(missing))


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _help_texts() -> dict[str, str]:
    from kvexport.cli import parser

    p = parser()
    texts = {"kvexport --help": p.format_help()}
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, sp in sub.choices.items():  # type: ignore[union-attr]
        texts[f"kvexport {name} --help"] = sp.format_help()
    return texts


def _source_strings() -> dict[str, str]:
    """file:line -> string literal (f-string parts included), for the product's code (not its tests)."""
    out: dict[str, str] = {}
    for folder in ("kvexport", "backends"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT)
            if "tests" in rel.parts:
                continue
            for node in ast.walk(ast.parse(f.read_text(), str(rel))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out[f"{rel}:{node.lineno}"] = node.value
    return out


def test_the_checker_catches_a_bogus_path(tmp_path: Path) -> None:
    text = ("see docs/no-such-page.md, NO-SUCH-NOTES.md, [a link](nowhere/else.md), backends/intel/missing.py;"
            " fine: docs/design.md, [design](docs/design.md#adding-an-architecture), https://example.com/x.md,"
            " backends/NAME/kvexport_NAME/")
    assert missing_paths(text) == ["NO-SUCH-NOTES.md", "backends/intel/missing.py", "docs/no-such-page.md",
                                   "nowhere/else.md"]


@pytest.mark.parametrize("doc", _markdown(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_in_markdown_exist(doc: Path) -> None:
    assert missing_paths(doc.read_text(), doc.parent) == [], f"{doc.relative_to(ROOT)} names paths that do not exist"


def test_paths_in_cli_help_exist() -> None:
    bad = {name: m for name, text in _help_texts().items() if (m := missing_paths(text))}
    assert not bad, bad


def test_paths_in_source_strings_exist() -> None:
    strings = _source_strings()
    assert len(strings) > 500  # the walk found the code
    bad = {where: m for where, text in strings.items() if (m := missing_paths(text))}
    assert not bad, bad
