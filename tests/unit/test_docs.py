"""The docs a user is sent to exist: every docs page (and anchor) an error hint, a comment or a
page names, every relative link of the README and docs/; the README stays short and for users."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAMED = re.compile(r"(?<![\w/.])(docs/[\w.-]+\.md)(#[\w-]+)?")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            base = slug(line.lstrip("#"))
            name, n = base, 1
            while name in found:  # repeated headings get -1, -2, ...
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def check(target: Path, anchor: str | None, where: str) -> list[str]:
    if not target.exists():
        return [f"{where}: {target.relative_to(REPO)} does not exist"]
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return [f"{where}: {target.relative_to(REPO)} has no heading #{anchor}"]
    return []


def test_every_docs_page_the_code_names_exists() -> None:
    """Hints and comments in neffkit/ (and the Makefile, bench/, tools/) name pages that exist."""
    sources = [
        *REPO.joinpath("neffkit").rglob("*.py"),
        *REPO.joinpath("bench").rglob("*.py"),
        *REPO.joinpath("tools").rglob("*.py"),
        REPO / "Makefile",
    ]
    bad = []
    for path in sources:
        for m in NAMED.finditer(path.read_text()):
            anchor = m.group(2)[1:] if m.group(2) else None
            bad += check(REPO / m.group(1), anchor, str(path.relative_to(REPO)))
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for m in LINK.finditer(page.read_text()):
        link = m.group(1)
        if "://" in link or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        bad += check(target, anchor or None, page.name)
    for m in NAMED.finditer(page.read_text()):  # pages named in prose: `docs/builds.md`
        bad += check(REPO / m.group(1), m.group(2)[1:] if m.group(2) else None, page.name)
    assert not bad, bad


def test_readme_is_short_and_for_users() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in [*PAGES, *REPO.joinpath("neffkit").rglob("*.py")]:
        text = page.read_text().lower()
        assert 'design.md"' not in text, page.relative_to(REPO)
    assert not re.search(r"(?<!docs/)DESIGN\.md", readme)


# each command's reference page (the top-level options: the build page's command line section)
COMMAND_PAGES = {
    "": "builds.md",
    "build": "builds.md",
    "compile": "builds.md",
    "convert": "models.md",
    "inspect": "inspect.md",
    "run": "serving.md",
}


def test_every_command_line_option_is_in_its_commands_page() -> None:
    """Each option `--help` lists (its long or its short form) appears on its command's page."""
    from neffkit.cli import cli

    commands = {"": cli, **cli.commands}
    assert set(commands) == set(COMMAND_PAGES)
    missing = []
    for name, command in commands.items():
        page = (DOCS / COMMAND_PAGES[name]).read_text()
        for param in command.params:
            names = [o for o in param.opts + param.secondary_opts if o.startswith("-")]
            spelled = (re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", page) for o in names)
            if names and not any(spelled):
                missing.append(f"neffkit {name} {names[0]} (docs/{COMMAND_PAGES[name]})")
    assert not missing, missing


def test_the_fields_the_docs_call_unimplemented_are_refused() -> None:
    """troubleshooting.md's unimplemented fields, each sent with a value: a 400 naming it."""
    from neffkit.errors import RequestError
    from neffkit.runtime.serve.protocol import parse_chat, parse_completion

    row = next(
        line
        for line in (DOCS / "troubleshooting.md").read_text().splitlines()
        if line.startswith("| an unimplemented field")
    )
    assert re.findall(r"`(\w+)`", row) == ["best_of", "suffix", "echo"]
    for parse, field, value in (
        (parse_completion, "best_of", 2),
        (parse_completion, "suffix", "x"),
        (parse_chat, "echo", True),
    ):
        body = {"prompt": "a", "messages": [{"role": "user", "content": "a"}], field: value}
        with pytest.raises(RequestError) as err:
            parse(body, "m")
        assert err.value.param == field
