"""The pages a person reads stay true to the code: AB-training's options table has one row per option with its
default, and every relative link of the README and docs/ (the notes included) leads to a file of the repository, and
docs/benchmarks.md names every folder of stored reports."""

import re
from dataclasses import fields
from pathlib import Path

from abtrain.methods.ab import ABConfig

ROOT = Path(__file__).parents[1]


def _options_rows() -> dict[str, list[str]]:
    """The rows of docs/ab-training.md's "Options" table, by flag: the flag's cells after its own."""
    section = (ROOT / "docs" / "ab-training.md").read_text().split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        m = re.match(r"\| `(--ab-[a-z0-9-]+)` \|(.*)\|$", line)
        if m:
            assert m[1] not in rows, f"{m[1]} has two rows in docs/ab-training.md's options table"
            rows[m[1]] = [cell.strip() for cell in m[2].split(" | ")]
    return rows


def _shown(value: object) -> str:
    """How the table writes an option's default: none, on / off, or the value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def test_the_options_table_has_one_row_per_option_of_abconfig():
    flags = {"--ab-" + f.name.replace("_", "-") for f in fields(ABConfig)}
    rows = _options_rows()
    assert sorted(flags - rows.keys()) == [], "options without a row in docs/ab-training.md"
    assert sorted(rows.keys() - flags) == [], "rows of docs/ab-training.md for options ABConfig does not have"


def test_each_row_gives_the_default_that_abconfig_resolves():
    rows, defaults = _options_rows(), ABConfig()  # the derived defaults (tau, split, payload, core, svd) resolved
    for f in fields(ABConfig):
        flag = "--ab-" + f.name.replace("_", "-")
        cell = rows[flag][0]
        first = re.match(r"`([^`]+)`|(\w+)", cell)
        assert first is not None, f"{flag}: no default in {cell!r}"
        written, value = first[1] or first[2], getattr(defaults, f.name)
        if isinstance(value, float):
            assert float(written) == value, f"{flag}: the table says {written}, ABConfig {value}"
        else:
            assert written == _shown(value), f"{flag}: the table says {written}, ABConfig {_shown(value)}"


def test_relative_links_of_the_pages_lead_to_files_of_the_repository():
    docs = ROOT / "docs"
    pages = [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "notebook").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#", 1)[0]
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or not path:
                continue  # a URL, or an anchor in the page itself
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_every_stored_report_folder_has_its_row_in_benchmarks_md():
    """docs/benchmarks.md's "The stored reports" names each folder of docs/results/, with the command that wrote it,
    and no folder that is not there."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    section = page.split("\n## The stored reports\n", 1)[1].split("\n## ", 1)[0]
    named = {name for line in section.splitlines() if line.startswith("| `")
             for name in re.findall(r"`([^`]+)`", line.split(" | ", 1)[0])}
    stored = {p.name for p in (ROOT / "docs" / "results").iterdir() if p.is_dir()}
    assert sorted(stored - named) == [] and sorted(named - stored) == []
