"""The documentation site (issue 31 item 6): every page is in the sidebar, and the
checkout's links are pointed at the site's pages (``tools/mkdocs_hooks.py``). The site
itself is built by ``make docs`` (CI, ``--strict``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
mkdocs_hooks = pytest.importorskip("mkdocs_hooks", reason="mkdocs is not installed (the docs extra)")


def _nav_pages(nav) -> set[str]:
    pages: set[str] = set()
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            pages |= _nav_pages(value)
        else:
            pages.add(value)
    return pages


def test_every_page_is_in_the_sidebar_and_every_sidebar_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    docs = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")
            if "examples" not in p.parts}
    generated = set(mkdocs_hooks.TOP_PAGES.values())
    assert nav == docs | generated


def test_links_of_the_checkout_point_at_the_site_s_pages():
    rewrite = mkdocs_hooks.rewrite_links
    # the README is the home page: its docs/ links lose the prefix, VALIDATION.md is a page
    assert rewrite("[Plan](docs/plan.md#x) and [V](VALIDATION.md)", "README.md") == \
        "[Plan](plan.md#x) and [V](validation.md)"
    # from a page of docs/: the top-level files by their pages, a sub-folder's page as is
    assert rewrite("[V](../VALIDATION.md#5) [R](scaling/v4-weak/results.md)", "docs/plan.md") == \
        "[V](validation.md#5) [R](scaling/v4-weak/results.md)"
    assert rewrite("[up](../../plan.md)", "docs/scaling/v4-weak/results.md") == "[up](../../plan.md)"
    # a source file is no page: its text stays, as code
    assert rewrite("see [fidelity](benchmarks/fidelity.py)", "README.md") == "see `fidelity`"
    assert rewrite("[`chip/spec.py`](chip/spec.py)", "VALIDATION.md") == "`chip/spec.py`"
    # URLs, anchors and code blocks are left alone
    text = "[a](https://x.org/y.md) [b](#two-clocks)\n```\n[c](chip/spec.py)\n```\n"
    assert rewrite(text, "README.md") == text
