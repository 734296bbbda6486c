"""MkDocs hooks for the documentation site (``mkdocs.yml``, ``make docs``).

The site's pages are ``docs/*.md`` plus three files that live at the top of the
repository, where a reader of the checkout looks for them: README.md (the site's home
page), VALIDATION.md and BENCHMARKS.md. They are added to the build as generated
pages (not copied into docs/, so there is one source). Links are written for the
checkout (``docs/plan.md`` from the README, ``../VALIDATION.md`` from a page, a
source file such as ``benchmarks/fidelity.py``); ``on_page_markdown`` rewrites each to
the page it is on the site, and a link to a file that is not a page (source code, a
scenario) becomes its text in code format: the site has no copy of the source tree.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
#: the repository's top-level pages and where they are on the site
TOP_PAGES = {"README.md": "index.md", "VALIDATION.md": "validation.md",
             "BENCHMARKS.md": "benchmarks.md"}
_SITE_TO_REPO = {site: repo for repo, site in TOP_PAGES.items()}
#: a Markdown link or image: [text](target) / ![alt](target), target without spaces
_LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)\)")
#: fenced code blocks, left alone
_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)


def on_files(files: Files, config) -> Files:
    """Add README.md, VALIDATION.md and BENCHMARKS.md as the pages index.md,
    validation.md and benchmarks.md."""
    for repo, site in TOP_PAGES.items():
        files.append(File.generated(config, site, content=(ROOT / repo).read_text()))
    return files


def repo_path(src_uri: str) -> str:
    """The repository path of a site page's source (``index.md`` -> ``README.md``,
    ``plan.md`` -> ``docs/plan.md``)."""
    return _SITE_TO_REPO.get(src_uri, f"docs/{src_uri}")


def site_target(target: str, page_repo_path: str) -> str | None:
    """Where a link of the checkout points on the site, relative to the page (None: to
    no page of the site, e.g. a source file).

    Args:
        target: the link as written (``docs/plan.md#x``, ``../VALIDATION.md``, ``#x``).
        page_repo_path: the repository path of the page the link is on.
    """
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # a URL, an anchor, a site path
        return target
    path, _, anchor = target.partition("#")
    repo = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), path))
    if repo in TOP_PAGES:
        site = TOP_PAGES[repo]
    elif repo.startswith("docs/") and (ROOT / repo).exists():
        site = repo.removeprefix("docs/")
    else:
        return None
    page_site = TOP_PAGES.get(page_repo_path, page_repo_path.removeprefix("docs/"))
    relative = posixpath.relpath(site, posixpath.dirname(page_site) or ".")
    return relative + (f"#{anchor}" if anchor else "")


def rewrite_links(markdown: str, page_repo_path: str) -> str:
    """``markdown`` with every link outside code blocks pointed at its site page."""
    def link(match: re.Match) -> str:
        target = site_target(match["target"], page_repo_path)
        if target is not None:
            return f"{match['bang']}[{match['text']}]({target})"
        text = match["text"]
        return text if text.startswith("`") else f"`{text}`"

    out, last = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_LINK.sub(link, markdown[last:fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(_LINK.sub(link, markdown[last:]))
    return "".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Point the checkout's links at the site's pages."""
    return rewrite_links(markdown, repo_path(page.file.src_uri))
