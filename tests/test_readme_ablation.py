"""The README's ablation results are reports/ablation.md's, which `make ablation` wrote: every row of the README's
results table is a row of the report, and the report holds every cell of the default `ablation` params."""

from __future__ import annotations

from pipeline_support import REPO
from readme_support import readme_section

from stages.support.params import load_params

REPORT = REPO / "reports/ablation.md"


def table_rows(text: str) -> list[str]:
    """The body rows of every markdown table in `text` (header and rule rows dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [line for line in lines if not line.startswith(("| dataset |", "|---"))]


def test_the_readme_quotes_the_committed_ablation_report() -> None:
    quoted = table_rows(readme_section("## Does attention matter? The ablation"))
    assert quoted, "the README's ablation section has no results table: copy it from reports/ablation.md"
    report_rows = table_rows(REPORT.read_text())
    missing = [row for row in quoted if row not in report_rows]
    assert not missing, f"README rows not in {REPORT.name} (run `make ablation` and copy its table): {missing}"


def test_the_readme_shows_the_reports_picture() -> None:
    section = readme_section("## Does attention matter? The ablation")
    assert "](reports/ablation.png)" in section
    assert (REPO / "reports/ablation.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_committed_report_covers_every_default_cell() -> None:
    settings = load_params(REPO / "params.yaml").ablation
    cells = {tuple(cell.strip() for cell in row.split("|")[1:3]) for row in table_rows(REPORT.read_text())}
    assert cells == {(dataset, variant) for dataset in settings.datasets for variant in settings.variants}
    assert f"| {settings.seeds} |" in REPORT.read_text()
