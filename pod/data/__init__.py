"""Files shipped with the package: the scenarios and the monitoring folder.

``scenarios/*.yaml`` and ``monitoring/`` (Prometheus configuration, alert rules
and their unit tests, the Grafana dashboard and provisioning files) are the
checkout's top-level folders. Here ``pod/data/scenarios`` and
``pod/data/monitoring`` are symbolic links to them, so one copy lives in git;
a wheel holds real copies (``[tool.setuptools.package-data]`` in
pyproject.toml), so an installed ``tpu-pod`` finds them with no checkout.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["SHIPPED_SUFFIXES", "data_root", "shipped_files"]

# what a shipped folder holds; anything else there (a generator script, caches) stays
# in the checkout. pyproject.toml's package-data globs name the same suffixes.
SHIPPED_SUFFIXES = (".yaml", ".yml", ".json")


def data_root() -> Traversable:
    """The folder holding ``scenarios/`` and ``monitoring/`` (in the checkout or installed)."""
    return files(__name__)


def shipped_files(folder: str) -> Iterator[tuple[str, Traversable]]:
    """Every shipped file under one data folder, in a stable order.

    Args:
        folder: ``"scenarios"`` or ``"monitoring"``.

    Yields:
        (path relative to the data root with ``/`` separators, the file).

    Raises:
        FileNotFoundError: the folder is not shipped (a broken install).
    """
    top = data_root() / folder
    if not top.is_dir():
        raise FileNotFoundError(f"{folder}/ is missing from the installed package")
    yield from _walk(top, folder)


def _walk(node: Traversable, relative: str) -> Iterator[tuple[str, Traversable]]:
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        path = f"{relative}/{child.name}"
        if child.is_dir():
            if not child.name.startswith((".", "__")):
                yield from _walk(child, path)
        elif child.name.endswith(SHIPPED_SUFFIXES):
            yield path, child
