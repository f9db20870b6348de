"""What MLflow's UI would not show as written in a description (it renders them as Markdown)."""

from __future__ import annotations

from markdown_it import MarkdownIt


def markdown_problems(text: str) -> list[str]:
    """What a Markdown renderer would not show as written: raw HTML (MLflow's sanitizer drops a `<dataset>`)
    and emphasis (`_` or `*` pairs turning text italic). CommonMark, HTML on, as MLflow's renderer."""
    problems = []
    for block in MarkdownIt("commonmark").parse(text):
        if block.type == "html_block":
            problems.append(block.content)
        for token in block.children or []:
            if token.type == "html_inline" or token.type in ("em_open", "strong_open"):
                problems.append(f"{token.type}: {token.content or token.markup}")
    return problems
