"""The docs: the site builds with ``mkdocs build --strict`` and the README stays short with working links.

``mkdocs.yml`` turns every broken link, missing anchor and page left out of the nav into a warning, and
``--strict`` turns warnings into a failed build, so one build checks every page of ``docs/``. The README
is not part of the site: its relative links are checked here, against the files of the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 200

# [text](target) and [text](target "title"); images too. Targets with a scheme or only an anchor are not files.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A page of the repository outside the site (lab/research/, deploy/), which the docs name in code: mkdocs cannot
# link out of docs/, so these names are checked here.
_REPOSITORY_PAGE = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.md)`")


def _relative_links(markdown: str) -> list[str]:
    """The file targets of ``markdown``'s links, without their anchors, code blocks left out."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    targets = (match.group(1) for match in _LINK.finditer(prose))
    return [target.split("#", 1)[0] for target in targets if not _EXTERNAL.match(target) and not target.startswith("#")]


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; it must stay under {README_MAX_LINES}"


def test_readme_links_point_to_files() -> None:
    links = _relative_links(README.read_text())
    assert links, "README.md links into docs/"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_repository_pages_the_docs_name_exist() -> None:
    named = {
        (page.name, path)
        for page in sorted((ROOT / "docs").glob("*.md"))
        for path in _REPOSITORY_PAGE.findall(page.read_text())
    }
    missing = sorted((page, path) for page, path in named if not (ROOT / path).is_file())
    assert not missing, f"docs name repository pages that do not exist: {missing}"


def test_relative_links_are_found() -> None:
    markdown = "[a](docs/a.md#x) [b](https://example.com) [c](#anchor) ![d](img.png)\n```\n[e](f.md)\n```"
    assert _relative_links(markdown) == ["docs/a.md", "img.png"]
