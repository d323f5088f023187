"""The documentation stays true: the generated config page is current, the README stays short, links resolve, and
every config setting the pages name exists. No processes, no sockets: reading files and importing collab.config."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 300
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.M | re.S)  # a fenced code block, maybe indented
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "pt", "txt", "sh"}
SETTING = re.compile(r"`((?:task|training|averaging|checkpoint)\.[a-z0-9_]+(?:\.[a-z0-9_]+)*)")


def _generator():
    spec = importlib.util.spec_from_file_location("generate_config", DOCS / "generate_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans, where a link is only an example."""
    text = re.sub(FENCE, "", text)
    return re.sub(r"(`+)(?:(?!\1).)+\1", "", text)


def _links(text: str) -> list[str]:
    prose = _prose(text)
    inline = re.findall(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    defined = re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", prose, flags=re.M)
    return inline + defined


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for a Markdown file: lower case, punctuation dropped, spaces to hyphens,
    -1, -2, ... on repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in re.sub(FENCE, "", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "").lower()
        slug = "".join(c for c in title if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_configuration_page_is_generated_from_the_config_models():
    expected = _generator().render()
    current = (DOCS / "configuration.md").read_text(encoding="utf-8") if (DOCS / "configuration.md").exists() else ""
    assert current == expected, (
        "docs/configuration.md is stale (a config field, its default or its description changed): "
        "run `python3 docs/generate_config.py` and commit the result")


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to a page under docs/ and link it")


def test_relative_links_point_to_files_that_exist():
    broken = []
    for page in _pages():
        for target in _links(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part).resolve() if path_part else page
            name = page.relative_to(ROOT)
            if not resolved.exists():
                broken.append(f"{name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{name}: {target} (no heading makes #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_settings_named_in_the_docs_exist():
    generated = _generator().render()
    known = set(re.findall(r"^- `([a-z0-9_.]+)`", generated, flags=re.M))
    unknown = []
    for page in _pages():
        if page.name == "configuration.md":
            continue
        for name in SETTING.findall(page.read_text(encoding="utf-8")):
            if name.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # checkpoint.py is a file, not a setting
                continue
            if name not in known:
                unknown.append(f"{page.relative_to(ROOT)}: {name}")
    assert not unknown, "settings that no config model has (renamed or removed?):\n" + "\n".join(sorted(set(unknown)))
