"""MkDocs hook (mkdocs.yml `hooks:`) for the pages that include a file of the repository root with
pymdownx.snippets (docs/changelog.md: `--8<-- "CHANGELOG.md"`).

Such a file is written for GitHub, where its links to the documentation read `docs/benchmarks.md` from the
repository root; included into a page of the site they would point at `docs/docs/...` and fail the strict build.
A Markdown preprocessor that runs right after snippets rewrites `](docs/x)` to `](x)` on those pages only, so the
file stays right in both places. (Excluded from the site by mkdocs.yml's `exclude_docs`.)"""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor

# The site's pages whose content is a file of the repository root (they sit at the top of docs/).
ROOT_FILE_PAGES = frozenset({"changelog.md", "contributing.md"})
_DOCS_LINK = re.compile(r"\]\(docs/")
_current_page: str | None = None  # set before each page is rendered (MkDocs renders pages one at a time)


class _RootLinks(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        if _current_page not in ROOT_FILE_PAGES:
            return lines
        return [_DOCS_LINK.sub("](", line) for line in lines]


class _RootLinksExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:  # the name is Markdown's API
        md.preprocessors.register(_RootLinks(md), "grpo_root_links", 31)  # snippets is 32: right after it


def on_config(config: Any, **kwargs: Any) -> Any:
    config.markdown_extensions.append(_RootLinksExtension())
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    global _current_page
    _current_page = page.file.src_uri
    return markdown
