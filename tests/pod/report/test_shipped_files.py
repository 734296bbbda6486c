"""Shipped files: pod.data, the package-data globs, and ``tpu-pod init``."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pod.commands.init import init_directory
from pod.data import SHIPPED_SUFFIXES, data_root, shipped_files

ROOT = Path(__file__).resolve().parents[3]


def _globs() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]["pod.data"]


def _matches(path: str, glob: str) -> bool:
    parts, pattern = path.split("/"), glob.split("/")
    return len(parts) == len(pattern) and all(map(fnmatch.fnmatchcase, parts, pattern))


def test_the_data_folders_are_links_to_the_checkout_folders_not_copies():
    for name in ("scenarios", "monitoring"):
        link = ROOT / "pod" / "data" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve()


def test_package_data_globs_cover_exactly_the_shipped_files():
    shipped = [rel for folder in ("scenarios", "monitoring") for rel, _ in shipped_files(folder)]
    globs = _globs()
    for rel in shipped:
        assert any(_matches(rel, g) for g in globs), f"{rel} is not in the wheel's package-data"
    for glob in globs:
        assert glob.endswith(SHIPPED_SUFFIXES)
        assert any(_matches(rel, glob) for rel in shipped), f"{glob} matches nothing"
    assert {p.name for p in (ROOT / "scenarios").glob("*.yaml")} \
        == {rel.split("/")[-1] for rel in shipped if rel.startswith("scenarios/")}
    assert "monitoring/grafana/make_dashboard.py" not in shipped  # a developer tool


def test_init_writes_scenarios_and_monitoring_and_keeps_edits(tmp_path):
    target = tmp_path / "demo"
    first = init_directory(target)
    assert (target / "quickstart.yaml").read_bytes() == (ROOT / "scenarios" / "quickstart.yaml").read_bytes()
    for rel in ("prometheus.yml", "alerts.yml", "alerts_test.yml", "grafana/tpu-pod-dashboard.json",
                "grafana/provisioning/datasources/prometheus.yaml"):
        assert (target / "monitoring" / rel).read_bytes() == (ROOT / "monitoring" / rel).read_bytes()
    assert not first.unchanged and len(first.written) == len(list(target.rglob("*.y*ml"))) + 1
    again = init_directory(target)
    assert not again.written and len(again.unchanged) == len(first.written)
    edited = target / "quickstart.yaml"
    edited.write_text("name: mine\n")
    with pytest.raises(FileExistsError, match=r"quickstart.yaml already exists with other "
                                              r"content; pass --force"):
        init_directory(target)
    assert edited.read_text() == "name: mine\n"
    assert init_directory(target, overwrite=True).written == (edited,)


def test_init_through_the_cli_prints_what_to_run_next(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pod", "init", "demo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("demo: ") and " scenarios and " in out.stdout
    for command in ("tpu-pod run demo/quickstart.yaml", "tpu-pod monitor --config "
                    "demo/monitoring/prometheus.yml", "grafana server"):
        assert command in out.stdout, out.stdout
    (tmp_path / "demo" / "alerts.yml").write_text("")  # not a shipped path: no clash
    (tmp_path / "demo" / "quickstart.yaml").write_text("x")
    out = subprocess.run([sys.executable, "-m", "pod", "init", "demo"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--force" in out.stderr
    assert "Traceback" not in out.stderr


def test_data_root_is_a_folder_of_the_package():
    assert (data_root() / "scenarios" / "quickstart.yaml").is_file()
    assert (data_root() / "monitoring" / "prometheus.yml").is_file()
