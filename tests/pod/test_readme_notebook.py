"""The README's Python examples, run as a notebook in a real IPython kernel by
``jupyter nbconvert --execute`` (``tools/readme_notebook.py``): every cell runs, the
model summary is text, the plot shows once, a run shows one progress line (issue 25,
item 6). About a minute and a half: Ray starts in the kernel, a sweep of 22 points."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from readme_notebook import cells_of, readme_code  # noqa: E402


def _text(output) -> str:
    return str(output.get("data", {}).get("text/plain", output.get("text", "")))


def test_the_notebook_is_built_from_the_readme_paragraphs():
    cells = cells_of(readme_code(ROOT / "README.md"))
    assert cells[0] == "import pod" and cells[-1] == "pod.stop_cluster()"
    assert any(c.startswith('result.plot("run.png")') for c in cells)


@pytest.mark.slow
def test_the_readme_examples_run_as_a_notebook(tmp_path):
    import nbformat

    out = subprocess.run([sys.executable, str(ROOT / "tools/readme_notebook.py"),
                          "--workdir", str(tmp_path), "--timeout", "900"],
                         capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    cells = nbformat.read(Path(out.stdout.strip()), as_version=4).cells

    def outputs(prefix: str) -> list:
        return next(c.outputs for c in cells if c.source.startswith(prefix))

    shown = outputs('result.plot("run.png")')
    assert sum("image/png" in o.get("data", {}) for o in shown) == 1  # once, not twice
    assert (tmp_path / "run.png").stat().st_size > 1000
    assert "Model: transformer" in "".join(_text(o) for o in outputs("print(pod.describe("))
    run = outputs("# not quiet")
    progress = [o for o in run if _text(o).startswith("step ")]
    assert len(progress) == 1 and _text(progress[0]).startswith("step 10/10"), \
        [_text(o)[:80] for o in run]
    noise = [_text(o) for c in cells for o in c.outputs if o.output_type == "stream"
             and o.get("name") == "stderr"]
    assert not any("Missing packages" in text or "Traceback" in text for text in noise), noise
