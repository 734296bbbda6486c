"""The committed HLO modules (tests/data/hlo/, written by tools/hlo_snippets.py)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from pod.hlo import parse_hlo

DATA = Path(__file__).resolve().parents[2] / "data" / "hlo"
SNIPPETS = ("mlp_scan", "fsdp_block", "ring_permute", "matmul")


def snippet_text(name: str, platform: str) -> str:
    """The text of tests/data/hlo/<name>.<platform>.hlo.txt.gz."""
    return gzip.decompress((DATA / f"{name}.{platform}.hlo.txt.gz").read_bytes()).decode()


@pytest.fixture(scope="session")
def modules():
    """(name, platform) -> the parsed module, every committed snippet."""
    return {(n, p): parse_hlo(snippet_text(n, p)) for n in SNIPPETS for p in ("tpu", "cpu")}
