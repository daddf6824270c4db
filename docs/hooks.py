"""mkdocs hook: the site's home page is the README itself (its links into docs/ made
relative to the site), so the two never drift apart."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    text = (Path(config["config_file_path"]).parent / "README.md").read_text()
    text = re.sub(r"\]\(docs/", "](", text)  # (docs/x.md -> x.md)
    text = re.sub(r"`(benchmarks/RESULTS\.md)`", r"`\1` (in the repository)", text)
    files.append(File.generated(config, "index.md", content=text))
    return files


def on_page_markdown(markdown, page, config, files):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    """A page's link back to the README is the site's home page."""
    return markdown.replace("](../README.md)", "](index.md)")
