"""``tpu-pod monitor``: a local Prometheus scraping a run, in one command.

Starts the ``prometheus`` binary (Debian's package: ``apt-get install
prometheus``; it starts no service of its own) on 127.0.0.1 with the shipped
``monitoring/prometheus.yml`` and its alert rules, its storage in a temporary
directory, and stops it on Ctrl-C (or SIGTERM), removing that directory.
Prometheus runs in a session of its own so that the terminal's Ctrl-C reaches
this process only, which then stops Prometheus and waits for it.
"""

from __future__ import annotations

import errno
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pod.data import data_root
from pod.errors import MetricsError
from pod.safe_io import output_errors, read_regular, write_atomic

__all__ = ["MonitorOptions", "default_config", "find_prometheus", "monitor", "render_config",
           "targets_of", "demo_command"]

INSTALL_HINT = ("install it with 'sudo apt-get install prometheus' (Debian, Ubuntu) or from "
                "https://prometheus.io/download/")
_READY_TIMEOUT_S = 30.0  # Debian's Prometheus is ready in about a second; a busy host, more
_STOP_TIMEOUT_S = 20.0  # a clean shutdown writes the head block: a second or two


@dataclass(frozen=True)
class MonitorOptions:
    """What ``tpu-pod monitor`` starts.

    Attributes:
        config: the Prometheus configuration to start from (its ``rule_files`` are
            read relative to it, as Prometheus does).
        port: Prometheus' web port on 127.0.0.1.
        targets: ``host:port`` metrics endpoints to scrape instead of the config's
            (empty: the config's own, 127.0.0.1:9188 in the shipped one).
        scrape_interval_s: scrape and rule-evaluation interval in seconds instead of
            the config's (None: the config's, 5 s in the shipped one).
    """

    config: Path
    port: int = 9090
    targets: tuple[str, ...] = ()
    scrape_interval_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for target in self.targets:
            host, sep, port = target.rpartition(":")
            if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"target {target!r} is not host:port, e.g. 127.0.0.1:9188")
        if self.scrape_interval_s is not None and self.scrape_interval_s < 0.001:
            raise ValueError(f"scrape interval must be at least 1 ms, got "
                             f"{self.scrape_interval_s} s")


def default_config() -> Path:
    """The shipped monitoring/prometheus.yml (the package is installed as files, not zipped)."""
    return Path(str(data_root() / "monitoring" / "prometheus.yml"))


def find_prometheus() -> str:
    """Path of the ``prometheus`` binary on PATH.

    Raises:
        MetricsError: it is not installed (one line: how to install it).
    """
    found = shutil.which("prometheus")
    if found is None:
        raise MetricsError(f"monitor: the 'prometheus' binary is not on PATH; {INSTALL_HINT}")
    return found


def render_config(options: MonitorOptions) -> dict[str, Any]:
    """The configuration Prometheus gets: the source one with the options applied.

    ``rule_files`` become absolute (the result is written elsewhere); ``targets``
    replace the first scrape job's ``static_configs``; the interval replaces both
    the scrape and the evaluation interval.

    Raises:
        MetricsError: the source configuration is missing or not a YAML mapping.
    """
    try:  # a regular file only (a FIFO would hang), at most 1 MiB
        text = read_regular(options.config, 1 << 20, "Prometheus configurations").decode()
        doc = yaml.safe_load(text)
    except ValueError as err:
        raise MetricsError(f"monitor: {err}") from None
    except (OSError, yaml.YAMLError) as err:
        raise MetricsError(f"monitor: cannot read {options.config}: "
                           f"{getattr(err, 'strerror', None) or err}") from None
    if not isinstance(doc, dict) or not doc.get("scrape_configs"):
        raise MetricsError(f"monitor: {options.config} is not a Prometheus configuration with "
                           f"scrape_configs")
    here = options.config.resolve().parent
    doc["rule_files"] = [str(here / rule) for rule in doc.get("rule_files") or []]
    if options.targets:
        doc["scrape_configs"][0]["static_configs"] = [{"targets": list(options.targets)}]
    if options.scrape_interval_s is not None:
        interval = _duration(options.scrape_interval_s)
        doc.setdefault("global", {}).update(scrape_interval=interval, evaluation_interval=interval)
        for job in doc["scrape_configs"]:
            job.pop("scrape_interval", None)
    return doc


def _duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: 5 -> "5s", 0.5 -> "500ms" (millisecond resolution)."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def _check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise MetricsError(f"monitor: port {port} on 127.0.0.1 is already in use; choose "
                                   f"another with --port") from None
            raise MetricsError(f"monitor: cannot use port {port}: {err.strerror}") from None


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "level=error" in line] or lines
    return errors[-1].strip() if errors else "no output"


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops the monitor as Ctrl-C does (Prometheus, in its own session, gets neither)."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise MetricsError(f"monitor: prometheus exited with status {proc.returncode}: "
                               f"{_last_error(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise MetricsError(f"monitor: prometheus is not ready after "
                                   f"{_READY_TIMEOUT_S:.0f} s: {_last_error(log)}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def monitor(options: MonitorOptions, echo: Callable[[str], None]) -> None:
    """Run Prometheus until Ctrl-C or SIGTERM, then stop it and remove its data.

    Args:
        options: configuration, port, targets, interval.
        echo: prints one line for the user.

    Raises:
        MetricsError: no ``prometheus`` binary, the port is taken, the configuration
            cannot be read, or Prometheus exits or is not ready in time (the message
            quotes its last error line).
    """
    binary = find_prometheus()
    _check_port_free(options.port)
    config = render_config(options)
    with output_errors(tempfile.gettempdir()):  # a full or read-only /tmp: one line
        scratch = tempfile.TemporaryDirectory(prefix="tpu-pod-monitor-")
    with scratch as tmp, _sigterm_as_interrupt():
        work = Path(tmp)
        config_path, log_path = work / "prometheus.yml", work / "prometheus.log"
        text = yaml.safe_dump(config, sort_keys=False)
        write_atomic(config_path, lambda f: f.write(text))
        with output_errors(log_path), open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={config_path}", f"--storage.tsdb.path={work / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{options.port}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            _wait_ready(proc, options.port, log_path)
            targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", [])
                       for t in sc.get("targets", [])]
            interval = config.get("global", {}).get("scrape_interval", "1m")
            echo(f"Prometheus on http://127.0.0.1:{options.port} scraping {', '.join(targets)} "
                 f"every {interval} (pid {proc.pid})")
            echo(f"Configuration from {options.config}; data and log in {work} (removed on exit)")
            echo(f"Start a run in another terminal, e.g. {demo_command()}; "
                 "Ctrl-C stops Prometheus")
            code = proc.wait()
            raise MetricsError(f"monitor: prometheus exited with status {code}: "
                               f"{_last_error(log_path)}")
        except KeyboardInterrupt:
            code = _stop(proc)
            echo(f"Prometheus stopped (exit status {code}); removed {work}")
        finally:
            _stop(proc)


def demo_command(cwd: Path | None = None) -> str:
    """A run to scrape, as it runs from ``cwd`` (default: here): the quick start, by its
    path there in a checkout or a folder of ``tpu-pod init``, else by the shipped file's
    path; ``--hold`` keeps its final values up for the scrapes after the last step."""
    here = Path.cwd() if cwd is None else cwd
    local = Path("scenarios") / "quickstart.yaml"
    if (here / local).is_file():
        path = str(local)
    elif (here / "quickstart.yaml").is_file():
        path = "quickstart.yaml"
    else:
        path = str(data_root() / "scenarios" / "quickstart.yaml")
    return f"tpu-pod run {shlex.quote(path)} --hold"


def targets_of(values: Sequence[str]) -> tuple[str, ...]:
    """``--target`` values, comma-separated or repeated, as one tuple."""
    return tuple(t.strip() for value in values for t in value.split(",") if t.strip())
