"""The README and the docs say what the code does (issue 29): the README is
short and its links lead somewhere, and the configuration reference is the
code's own settings table (``mkdocs build --strict`` in .ci/run checks the
site's links and navigation)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from lmcache_tiered.config import PREFIX, SETTINGS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"
#: The generated table's bounds in docs/configuration.md.
BEGIN = "<!-- the settings table: made from lmcache_tiered.config.SETTINGS by "
BEGIN += "python tests/test_docs.py; edit the code, not this table -->"
END = "<!-- end of the settings table -->"


def shown(default: Any) -> str:
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def settings_table() -> str:
    """docs/configuration.md's table, one row per entry of SETTINGS."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for name, setting in SETTINGS.items():
        default = setting.shown or shown(setting.default)
        meaning = setting.help.replace("|", "\\|")
        rows.append(f"| `{PREFIX}{name}` | {default} | {meaning} |")
    return "\n".join(rows)


def test_the_configuration_reference_is_the_settings_table() -> None:
    text = CONFIGURATION.read_text()
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert table == settings_table(), (
        "docs/configuration.md differs from config.SETTINGS: run "
        "python tests/test_docs.py to write it anew"
    )


def test_the_readme_is_short_and_every_link_in_it_resolves() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not t.startswith(("http://", "https://"))]
    assert local, "the README links into the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == []


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


if __name__ == "__main__":  # write the settings table into docs/configuration.md
    text = CONFIGURATION.read_text()
    head, tail = text[: text.index(BEGIN) + len(BEGIN)], text[text.index(END) :]
    CONFIGURATION.write_text(f"{head}\n{settings_table()}\n{tail}")
