"""Run the README's Python examples as a Jupyter notebook, as a user would.

The ```python blocks of the README's "From Python (notebooks)" section become the
cells of a notebook (a cell per paragraph: blank lines split them, so that each
paragraph's last expression is shown as a notebook shows it), which
``jupyter nbconvert --execute`` runs in a real IPython kernel. The notebook lives
in a working directory of its own holding a link to the checkout's ``scenarios/``,
so the relative paths of the examples resolve and what they write (``run.png``,
``runs/``) stays there.

Usage::

    python tools/readme_notebook.py [--readme README.md] [--workdir DIR] [--timeout S]

prints the executed notebook's path; exit status 1 when a cell raised (its error is
printed), 2 when the README has no such section.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## From Python (notebooks)"


def readme_code(readme: Path, section: str = SECTION) -> list[str]:
    """The ```python blocks of ``section`` (up to the next ``## `` heading), in order.

    Raises:
        ValueError: no such section, or no python block in it.
    """
    text = readme.read_text()
    start = text.find(section + "\n")
    if start < 0:
        raise ValueError(f"{readme}: no section {section!r}")
    end = text.find("\n## ", start + len(section))
    body = text[start:end if end >= 0 else len(text)]
    blocks = re.findall(r"^```python\n(.*?)^```$", body, flags=re.M | re.S)
    if not blocks:
        raise ValueError(f"{readme}: no ```python block in {section!r}")
    return blocks


def cells_of(blocks: list[str]) -> list[str]:
    """A cell per paragraph of every block (blank lines split paragraphs)."""
    cells = []
    for block in blocks:
        cells.extend(p.strip("\n") for p in re.split(r"\n\s*\n", block) if p.strip())
    return cells


def build(readme: Path, workdir: Path) -> Path:
    """Write ``workdir/readme.ipynb`` from the README's examples, with ``scenarios``
    linked to the checkout's; returns the notebook's path."""
    import nbformat

    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "scenarios"
    if not link.exists():
        link.symlink_to(ROOT / "scenarios", target_is_directory=True)
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    notebook.cells = [nbformat.v4.new_code_cell(cell) for cell in cells_of(readme_code(readme))]
    path = workdir / "readme.ipynb"
    nbformat.write(notebook, path)
    return path


def execute(notebook: Path, timeout_s: float = 1200) -> Path:
    """Run ``jupyter nbconvert --execute`` on the notebook in its directory; returns the
    executed copy (``<name>.executed.ipynb``), written even when a cell raised.

    Raises:
        RuntimeError: nbconvert failed (a cell raised, or the kernel died); its
            message ends with nbconvert's own last lines.
    """
    out = notebook.with_suffix(".executed.ipynb")
    done = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
         "--allow-errors", f"--ExecutePreprocessor.timeout={int(timeout_s)}",
         "--output", out.name, notebook.name],
        cwd=notebook.parent, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nbconvert failed on {notebook}: {done.stderr.strip()[-3000:]}")
    return out


def errors(executed: Path) -> list[str]:
    """Each failed cell's source and error, one string per cell."""
    import nbformat

    found = []
    for cell in nbformat.read(executed, as_version=4).cells:
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                found.append(f"{cell.source}\n-> {output.ename}: {output.evalue}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the notebook and what it writes go [default: a new "
                             "temporary directory]")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per cell")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="readme-notebook-"))
    try:
        notebook = build(args.readme, workdir)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    executed = execute(notebook, args.timeout)
    print(executed)
    failed = errors(executed)
    for text in failed:
        print(f"error in cell:\n{text}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
