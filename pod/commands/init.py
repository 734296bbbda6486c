"""``tpu-pod init DIR``: copy the shipped scenarios and monitoring files out of the package.

An installed ``tpu-pod`` has no checkout next to it: this writes the scenarios
(``DIR/*.yaml``) and the monitoring folder (``DIR/monitoring/``: Prometheus
configuration, alert rules and their unit tests, the Grafana dashboard and its
provisioning files) where the user can run and edit them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pod.data import shipped_files
from pod.safe_io import write_atomic

__all__ = ["InitResult", "init_directory", "next_steps"]


@dataclass(frozen=True)
class InitResult:
    """What ``init_directory`` did.

    Attributes:
        directory: the directory written to.
        written: files written (new, or replaced with ``overwrite``), in order.
        unchanged: files already there with the shipped content, left alone.
    """

    directory: Path
    written: tuple[Path, ...]
    unchanged: tuple[Path, ...]


def _destination(relative: str) -> Path:
    """scenarios/x.yaml -> x.yaml (next to each other, as ``tpu-pod run DIR/x.yaml`` expects);
    monitoring/... keeps its folder (prometheus.yml names alerts.yml beside it)."""
    top, _, rest = relative.partition("/")
    return Path(rest) if top == "scenarios" else Path(relative)


def init_directory(directory: Path, *, overwrite: bool = False) -> InitResult:
    """Copy the shipped scenarios and monitoring files into ``directory``.

    Args:
        directory: created if missing, with its parents.
        overwrite: replace files that exist with other content.

    Returns:
        The files written and the ones already up to date.

    Raises:
        FileExistsError: a file there differs from the shipped one and ``overwrite``
            is false (the message names it and the option that replaces it); nothing
            is written then.
        NotADirectoryError: ``directory`` is a file.
        OutputError: a file or folder cannot be written there (``/proc/foo``, a
            read-only file system, no space); one line naming it.
    """
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file, not a directory")
    plan = [(directory / _destination(rel), src.read_bytes())
            for folder in ("scenarios", "monitoring") for rel, src in shipped_files(folder)]
    unchanged = [dest for dest, data in plan if dest.is_file() and dest.read_bytes() == data]
    clashes = [dest for dest, _ in plan if dest.exists() and dest not in unchanged]
    if clashes and not overwrite:
        what = (f"{clashes[0]} and {len(clashes) - 1} more files already exist"
                if len(clashes) > 1 else f"{clashes[0]} already exists")
        raise FileExistsError(f"{what} with other content; pass --force to replace them")
    written = []
    for dest, data in plan:
        if dest in unchanged:
            continue

        def write(f: Any, data: bytes = data) -> None:
            f.write(data)

        write_atomic(dest, write, binary=True, make_parents=True)
        written.append(dest)
    return InitResult(directory, tuple(written), tuple(unchanged))


def next_steps(directory: Path) -> list[str]:
    """The commands to run next, as lines to print (paths as the user typed them)."""
    d = directory
    return [
        "Next:",
        f"  tpu-pod validate {d}/*.yaml",
        "      check every scenario",
        f"  tpu-pod run {d / 'quickstart.yaml'} --hold",
        "      train the quick start (v2-8, CNN, digits); metrics on 127.0.0.1:9188",
        f"  tpu-pod monitor --config {d / 'monitoring' / 'prometheus.yml'}",
        "      in another terminal: Prometheus on http://127.0.0.1:9090 scraping the run",
        f"  cd {d} && grafana server --homepath /usr/share/grafana "
        f"cfg:default.paths.provisioning=\"$PWD/monitoring/grafana/provisioning\"",
        "      optional: Grafana on http://127.0.0.1:3000 showing the TPU pod dashboard",
    ]
