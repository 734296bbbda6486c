"""Start or join the Ray cluster the chip actors run on.

A local cluster is started when no address is given (the scenario's
``ray.address``, else the ``RAY_ADDRESS`` environment variable):

- bound to 127.0.0.1, logs at ERROR, dashboard off (on with ``dashboard=True``:
  ``ray.dashboard`` / ``tpu-pod run --ray-dashboard``, also on 127.0.0.1);
- with Ray's task events off (``RAY_task_events_report_interval_ms=0``, unless
  set): the GCS kept every actor call's events, about 12 KB per step, and a
  long run's GCS grew without end (``_LOCAL_RAY_SETTINGS``);
- with Ray's token authentication on and a fresh random token per process
  (``secrets.token_hex``), written to a file only its user can read and
  passed to Ray's processes with ``RAY_AUTH_MODE=token`` and
  ``RAY_AUTH_TOKEN_PATH``: another local process, even of another user, cannot
  join the cluster and run code in it without that token (Ray's default would
  share one token under the home directory between every cluster of a user);
- session files under its own directory, ``<tmp>/tpu-pod-ray-<uid>/<pid>``
  (``cluster_temp_dir``), removed at shutdown; directories left by emulator
  processes that no longer run are removed when the next local cluster starts
  (only these: Ray's own ``/tmp/ray`` and other users' clusters are not touched);
- Ray's daemons (GCS, raylet; Ray puts its workers in groups of their own)
  each in a process group of its own, so a SIGTERM sent to the driver's whole
  process group (what ``timeout`` and service managers send) reaches only the
  driver, which stops gracefully (final checkpoint, partial summary, exit 143)
  and then stops the cluster, instead of Ray's GCS dying under a running step.
  The GCS and raylet still die with the driver (Ray's own fate-sharing); the
  raylet's agents did not (they lingered about 60 s after a ``kill -9``, and
  the session directory for good): a reaper (``pod/runtime/reaper.py``), a
  small process holding a pipe from the driver, kills every process of the
  cluster and removes its directory when the driver dies without stopping it.
  A service manager that kills every process of the service's cgroup at once
  (systemd's default ``KillMode=control-group``) still reaches the daemons:
  use ``KillMode=mixed`` so that only the main process gets the SIGTERM first;
- a SIGTERM while ``ray.init`` runs keeps the run's own handler (Ray's would
  exit at once with status 15): the run stops at its first step boundary;
  Ray's C++ failure-signal handler is kept out (``pod/runtime/__init__.py``) and
  the run's handler is put back after ``ray.init``, so a SIGTERM while the
  actors start is the run's too (it printed a C++ stack and could abort, -6).

Joining a cluster you started yourself (``ray.address: host:port``, or
``RAY_ADDRESS``): start it with token authentication, the default from Ray
2.60 on::

    ray start --head --port 6379            # writes a token to ~/.ray/auth_token
    ray start --address HEAD:6379           # on the other machines, same token

and run ``tpu-pod`` where the same token is available (``~/.ray/auth_token``,
or ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH``). "auto" is looked up as Ray
looks it up (what ``ray start`` recorded, else a GCS process on this machine).
The address is then tried, all within ``CONNECT_TIMEOUT_S``: a TCP connection,
an HTTP/2 greeting (the GCS is a gRPC server), and a request to the GCS by
Ray's own client with this process's token. An address where no cluster
answers, a port that accepts and never answers, an HTTP/2 or gRPC server that
is not a Ray GCS, a cluster that refuses the token, and "auto" with no cluster
fail within seconds with one line naming the address as given, instead of
Ray's minutes of retries; Ray's C++ messages while it connects go to a file
(``join_log_path``), not to the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import ray

from pod.errors import ClusterError, RunInterrupted

__all__ = ["kill_actors", "ensure_ray", "shutdown_ray", "cluster_temp_dir", "gcs_address",
           "CONNECT_TIMEOUT_S"]

#: Seconds to wait for a given cluster address to accept a connection.
CONNECT_TIMEOUT_S = 10.0

#: This process's token for the local clusters it starts (one per process: Ray's
#: token loader keeps the first token it reads for the process's lifetime).
_TOKEN: str | None = None
class _Started(TypedDict, total=False):
    """What this process changed to start its local cluster (each key once set)."""

    reaper: subprocess.Popen[str]  # the reaper process (_start_reaper)
    temp_dir: Path  # the cluster's session directory
    env: dict[str, str | None]  # the environment variables replaced (_use_run_token)
    loopback: tuple[str | None, bool | None]  # what _loopback_only replaced


#: The local cluster this process started: its temp dir and the environment it changed.
_STARTED: _Started = {}
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")
_CLUSTER_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
#: Ray's settings for the emulator's own local cluster (a value the user set is kept).
#: Task events off: every actor call's events were kept in the GCS (about 2.6 KB a
#: call, 12 KB a data-parallel step; 46 -> 291 MB over 20,000 steps). The GCS's RSS
#: with 8 actors after 0 / 40k / 80k / 120k calls (Ray 2.60, this machine): Ray's
#: default 61 -> 184 -> 304 -> 358 MB; with 0, 46.4 -> 47.5 -> 48.0 -> 48.2 MB.
_LOCAL_RAY_SETTINGS = {"RAY_task_events_report_interval_ms": "0"}


def _temp_root() -> Path:
    return Path(tempfile.gettempdir()) / f"tpu-pod-ray-{os.getuid()}"


def cluster_temp_dir(pid: int | None = None) -> Path:
    """Where the local cluster of process ``pid`` (default: this one) keeps its session files."""
    return _temp_root() / str(os.getpid() if pid is None else pid)


def _private_dir(path: Path) -> Path:
    """``path`` as a directory of this user only (0700), refusing a symlink or another owner."""
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ClusterError(f"{path}: not a directory of this user; refusing to put a Ray "
                           "cluster's files there")
    if stat.S_IMODE(info.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_dirs() -> None:
    """Remove the session directories of emulator processes that no longer run."""
    root = _temp_root()
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and not _alive(int(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)
        joined = re.fullmatch(r"join-(\d+)\.log", entry.name)  # a failed join's messages
        if joined and int(joined.group(1)) != os.getpid() and not _alive(int(joined.group(1))):
            with contextlib.suppress(OSError):
                entry.unlink()


def _use_run_token(directory: Path) -> dict[str, str | None]:
    """Turn on Ray's token authentication with this process's token, and the local
    cluster's settings (``_LOCAL_RAY_SETTINGS``), for this process and the Ray
    processes it starts; returns the environment it replaced."""
    global _TOKEN
    if _TOKEN is None:
        _TOKEN = secrets.token_hex(32)
    token_path = directory / "auth_token"
    fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_TOKEN)
    previous = {k: os.environ.get(k) for k in (*_AUTH_VARS, *_LOCAL_RAY_SETTINGS)}
    for key, value in _LOCAL_RAY_SETTINGS.items():
        os.environ.setdefault(key, value)
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray prefers it to the path: ours must win
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)
    from ray._raylet import Config  # type: ignore[attr-defined]  # ray/_raylet.pyi omits it

    Config.initialize("")  # this process reads RAY_AUTH_MODE (and the settings) again
    return previous


def _restore_env(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


class _DaemonsInTheirOwnGroups:
    """While inside, every process Ray's ``ray.init`` starts (GCS, raylet, their
    helpers) leads a process group of its own, out of the driver's group.

    Ray starts its daemons through ``ray._private.services.ConsolePopen`` (a
    ``subprocess.Popen``); it is swapped for a subclass passing
    ``process_group=0`` for the time of ``ray.init``, and put back after. This
    works whatever the driver is (a group leader, a session leader under a
    service manager). Ray's own fate-sharing (``PR_SET_PDEATHSIG``) still
    ends the daemons with the driver. Where that class is missing (another Ray
    version) nothing changes.
    """

    def __enter__(self) -> _DaemonsInTheirOwnGroups:
        from ray._private import services

        self.services = services
        self.original = getattr(services, "ConsolePopen", None)
        if sys.platform != "win32" and isinstance(self.original, type) and \
                issubclass(self.original, subprocess.Popen):
            original = self.original

            class OwnGroupPopen(original):  # type: ignore[misc, valid-type]
                def __init__(self, *args: object, **kwargs: object) -> None:
                    kwargs.setdefault("process_group", 0)
                    super().__init__(*args, **kwargs)
                    _tell_reaper(f"group {self.pid}")  # it leads its own group

            # swapped for the time of ray.init (mypy refuses any assignment to a class name)
            services.ConsolePopen = OwnGroupPopen  # type: ignore[misc]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.original is not None:
            self.services.ConsolePopen = self.original  # type: ignore[misc]  # put back


def _start_reaper(temp_dir: Path) -> None:
    """Start the cluster's reaper (``pod/runtime/reaper.py``): it ends Ray's processes
    and removes ``temp_dir`` if this process dies without ``shutdown_ray``."""
    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", str(Path(__file__).with_name("reaper.py"))],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, text=True, bufsize=1)
    _STARTED["reaper"] = reaper
    _tell_reaper(f"env RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}")
    _tell_reaper(f"dir {temp_dir}")


def _tell_reaper(line: str) -> None:
    reaper = _STARTED.get("reaper")
    if reaper is not None and reaper.stdin is not None:
        with contextlib.suppress(OSError, ValueError):  # it died: nothing to tell
            reaper.stdin.write(line + "\n")


def _stop_reaper() -> None:
    """The cluster is stopped: the reaper has nothing to do; it exits."""
    reaper = _STARTED.pop("reaper", None)
    if reaper is None:
        return
    assert reaper.stdin is not None  # started with stdin=PIPE
    try:
        reaper.stdin.write("done\n")
        reaper.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        reaper.wait(timeout=5)
    except subprocess.TimeoutExpired:
        reaper.kill()


class _KeepSigtermHandler:
    """While inside, Ray does not replace a SIGTERM handler this process installed.

    ``ray.init`` installs handlers that exit at once (status 15, or 1 after
    killing its processes): a SIGTERM during start-up would end a run without a
    line or a summary. A run's ``InterruptGuard`` is already handling SIGTERM
    then: it is kept, and the run stops at its first step boundary (exit 143).
    Without a Python handler of ours (the default action), Ray's are installed
    as usual.
    """

    def __enter__(self) -> _KeepSigtermHandler:
        from ray._private import utils

        self.utils, self.original = utils, utils.set_sigterm_handler
        self.kept = signal.getsignal(signal.SIGTERM)
        if callable(self.kept):
            utils.set_sigterm_handler = lambda handler: None
        return self

    def __exit__(self, *exc: object) -> None:
        self.utils.set_sigterm_handler = self.original
        if callable(self.kept):  # C++ code (absl) may have taken SIGTERM over: take it back
            signal.signal(signal.SIGTERM, self.kept)


def _check_reachable(address: str, timeout_s: float, *, as_given: str | None = None,
                     field: str = "ray.address") -> None:
    """A Ray cluster answers at ``address`` ("host:port", "ray://host:port") within
    ``timeout_s``: one gRPC request to its GCS over one connection, with this
    process's token (``pod.runtime.gcs_probe``), so that a port that accepts and never
    answers, an HTTP/2 or gRPC server that is not a Ray GCS and a cluster that
    refuses the token fail within the bound, rather than leaving ``ray.init``
    waiting for minutes. A Ray Client address ("ray://") needs only an HTTP/2
    answer; other forms ("local") are left to Ray; with ``RAY_USE_TLS`` only the
    connection is checked.

    Args:
        address: where to connect.
        timeout_s: the bound, wall seconds.
        as_given: the address as the user gave it, for the message ("auto").
        field: what the user set it in (``ray.address`` or ``RAY_ADDRESS``).

    Raises:
        ClusterError: nothing answers there, or not as a Ray cluster, or the
            cluster refused the token; one line naming the address as given.
    """
    from pod.runtime.gcs_probe import ask_gcs

    match = re.fullmatch(r"(ray://)?\[?([^\]\s]+?)\]?:(\d+)", address.strip())
    if not match:
        return
    client, host, port = match.group(1), match.group(2), int(match.group(3))
    t0 = time.monotonic()
    named = repr(as_given or address) + (f" (found {address})" if as_given not in (None, address)
                                         else "")

    def fail(reason: str) -> ClusterError:
        return ClusterError(f"{field}: no Ray cluster answers at {named} ({reason}, after "
                            f"{time.monotonic() - t0:.1f} s); start one there, or remove "
                            "ray.address and RAY_ADDRESS to run on a local cluster")

    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as err:
            raise fail(err.strerror or str(err)) from None
        return
    token = _token_headers()
    answer = ask_gcs(host, port, timeout_s, token)
    if answer.kind == "gcs" or (client and answer.kind == "refused"):
        return
    if answer.kind == "refused":
        raise ClusterError(
            f"{field}: the server at {named} refused a Ray GCS request ({answer.detail}): "
            + ("it refuses this process's Ray token, or it is not a Ray cluster"
               if token else "this process has no Ray token (~/.ray/auth_token, RAY_AUTH_TOKEN "
               "or RAY_AUTH_TOKEN_PATH with RAY_AUTH_MODE=token), or it is not a Ray cluster"))
    if answer.kind == "not_http2":
        raise fail("something answers there, but not a Ray cluster (no gRPC answer)")
    raise fail(answer.detail)


def _token_headers() -> dict[str, str]:
    """The ``authorization`` header Ray's own clients would send from this process
    (its token, when Ray's token authentication is on for it); {} if none."""
    try:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

        loader = AuthenticationTokenLoader.instance()
        return dict(loader.get_token_for_http_header()) if loader.has_token() else {}
    except Exception:  # noqa: BLE001 - a Ray without token authentication
        return {}


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None,
               connect_timeout_s: float = CONNECT_TIMEOUT_S, dashboard: bool = False) -> bool:
    """Make sure this process is connected to a Ray cluster.

    Args:
        address: an existing cluster to join ("auto", "host:port",
            "ray://..."); None uses ``RAY_ADDRESS`` or starts a local cluster.
        num_cpus: CPUs a local cluster advertises (default: the machine's).
        connect_timeout_s: how long a given address may take to accept a
            connection.
        dashboard: a local cluster serves Ray's dashboard on 127.0.0.1:8265
            (``ray.dashboard`` in a scenario, ``tpu-pod run --ray-dashboard``);
            it needs Ray's optional dashboard packages (``ray[default]``).

    Returns:
        True if this call started a local cluster (so the caller owns it and
        should shut it down with ``shutdown_ray``), False if Ray was already
        up or was joined.

    Raises:
        ClusterError: the address not joined (one line naming the address as
            given), or a local cluster that did not start, twice (one line saying
            so: under load Ray's own start-up waits run out).
    """
    if ray.is_initialized():
        return False
    field = "ray.address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _join(address, connect_timeout_s, field)
        return False
    if dashboard:
        _check_dashboard_packages()
    for attempt in (1, 2):
        t0 = time.monotonic()
        try:
            _start_local(num_cpus, dashboard)
            return True
        except (ClusterError, RunInterrupted):
            _stop_started()
            raise
        except Exception as err:  # noqa: BLE001 - Ray raises many kinds; one clear line
            _stop_started()
            if attempt == 2:
                raise ClusterError(_not_started(err, time.monotonic() - t0)) from None
            print(f"the local Ray cluster did not start ({_first_line(err)}); trying once "
                  "more", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _not_started(err: BaseException, seconds: float) -> str:
    """The one line of a local cluster that did not start twice: a timeout (what load
    does to Ray's start-up waits) said as such, with the load average; anything else
    with Ray's own first line. Never ``ray.address``: the user set none."""
    try:
        load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count() or 1} cores"
    except OSError:
        load = "load unknown"
    if isinstance(err, TimeoutError) or "timed out" in str(err).lower() or \
            "timeout" in type(err).__name__.lower():
        return (f"ray: the local Ray cluster did not start within {seconds:.0f} s, twice "
                f"(machine busy? {load}); try again when it is quieter, or start one with "
                "`ray start --head` and set RAY_ADDRESS (or run with --in-process: no Ray)")
    return (f"ray: could not start a local Ray cluster, twice ({load}): {_first_line(err)}")


def _join(address: str, connect_timeout_s: float, field: str = "ray.address") -> None:
    """Join the cluster at ``address`` (the scenario's ``ray.address`` or ``RAY_ADDRESS``,
    which ``field`` names): "auto" is looked up first as Ray looks it up (the
    cluster ``ray start`` recorded, else a GCS process of this machine), and the
    address is checked within ``connect_timeout_s`` (``_check_reachable``) before
    ``ray.init``. Ray's C++ messages while it connects (they repeat for minutes
    when nothing answers) go to a file (``join_log_path``), never to the
    terminal; the file is removed after a join that worked, and named in the
    error of one that did not.

    Raises:
        ClusterError: nothing answers there within the bound, "auto" finds no
            cluster, it is a dashboard's HTTP address, or Ray refused; one line
            naming the address as given.
    """
    if re.match(r"https?://", address.strip()):
        raise ClusterError(
            f"{field}: {address!r} is the address of Ray's dashboard (what `ray job submit` "
            "takes); tpu-pod joins the cluster itself at HEAD:6379 (unset RAY_ADDRESS inside "
            "a Ray job, where Ray sets it)")
    log = join_log_path()
    try:
        with _stderr_to(log):
            target = _resolve(address, field)
            _check_reachable(target, connect_timeout_s, as_given=address, field=field)
            with _KeepSigtermHandler():
                ray.init(address=target, logging_level=logging.ERROR, log_to_driver=True)
    except ClusterError as err:
        raise ClusterError(_with_log(str(err), log)) from None
    except Exception as err:  # noqa: BLE001 - Ray raises many kinds; one clear line
        raise ClusterError(_with_log(f"{field}: could not join the Ray cluster at {address!r}: "
                                     f"{_first_line(err)}", log)) from None
    with contextlib.suppress(OSError):
        log.unlink()


def _resolve(address: str, field: str) -> str:
    """``address`` as host:port: "auto" as Ray resolves it (``ray start``'s record, else a
    GCS process found on this machine); any other form unchanged.

    Raises:
        ClusterError: "auto" finds no cluster, or several.
    """
    if address.strip() != "auto":
        return address
    from ray._private import services

    try:
        found = services.canonicalize_bootstrap_address(address)
    except Exception as err:  # noqa: BLE001 - ConnectionError, or another kind in another Ray
        raise ClusterError(f"{field}: 'auto' finds no Ray cluster to join on this machine "
                           f"({_first_line(err).split('. ')[0]}); start one (`ray start "
                           "--head`), or remove ray.address and RAY_ADDRESS to run on a "
                           "local cluster") from None
    return found or address


def join_log_path(pid: int | None = None) -> Path:
    """Where Ray's messages go while process ``pid`` (default: this one) joins a cluster."""
    return _private_dir(_temp_root()) / f"join-{os.getpid() if pid is None else pid}.log"


def _with_log(message: str, log: Path) -> str:
    """The error line, naming Ray's messages' file if Ray wrote any."""
    try:
        written = log.stat().st_size > 0
    except OSError:
        written = False
    if not written:
        with contextlib.suppress(OSError):
            log.unlink()
        return message
    return f"{message} (Ray's messages: {log})"


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 (where Ray's C++ code logs) appended to ``path`` inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _start_local(num_cpus: int | None, dashboard: bool) -> None:
    """Start a local cluster on 127.0.0.1 with a token of this process, its own session
    directory and its reaper (the module's docstring)."""
    _loopback_only()
    _private_dir(_temp_root())
    _remove_stale_dirs()
    temp_dir = _private_dir(cluster_temp_dir())
    previous = _use_run_token(temp_dir)
    _STARTED["temp_dir"], _STARTED["env"] = temp_dir, previous
    _start_reaper(temp_dir)
    with _DaemonsInTheirOwnGroups(), _KeepSigtermHandler():
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=dashboard,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            _temp_dir=str(temp_dir),
            logging_level=logging.ERROR,
            configure_logging=True,
            log_to_driver=False,  # actor errors still arrive as exceptions; no raylet chatter
        )


def _check_dashboard_packages() -> None:
    """Ray's dashboard runs only with its optional packages (``ray[default]``); without
    them Ray would start with no dashboard and say so only in its logs.

    Raises:
        ClusterError: they are missing; one line saying what to install.
    """
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - what Ray itself checks
    except ImportError as err:
        raise ClusterError(f"ray.dashboard: Ray's dashboard needs its optional packages "
                           f"({err.name or err} is missing): pip install "
                           f"'tpu-pod-emulator[dashboard]' (ray[default])") from None


def _loopback_only() -> None:
    """Keep a local cluster on 127.0.0.1.

    Ray replaces a loopback ``_node_ip_address`` by the machine's address unless
    its "cluster" mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read at
    import time): set it for the processes Ray starts (they inherit the
    environment) and for this one (the constant was read when ray was imported).
    Only for a cluster this process starts: joining a multi-machine cluster
    needs the real address.
    """
    from ray._private import ray_constants

    _STARTED.setdefault("loopback", (os.environ.get(_CLUSTER_VAR),
                                     getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)))
    os.environ[_CLUSTER_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _restore_loopback(previous: tuple[str | None, bool | None]) -> None:
    """Put back what ``_loopback_only`` changed: a later ``ray.init`` of the user's own in
    this process (a notebook) starts Ray as it would have."""
    from ray._private import ray_constants

    _restore_env({_CLUSTER_VAR: previous[0]})
    if previous[1] is not None:
        ray_constants.ENABLE_RAY_CLUSTER = previous[1]


def _cleanup_started() -> None:
    """Forget the local cluster this process started: its reaper, its environment
    and its files."""
    if not _STARTED:
        return
    _stop_reaper()
    if "env" in _STARTED:
        _restore_env(_STARTED.pop("env"))
        _forget_token()
    if "loopback" in _STARTED:
        _restore_loopback(_STARTED.pop("loopback"))
    if "temp_dir" in _STARTED:
        shutil.rmtree(_STARTED.pop("temp_dir"), ignore_errors=True)
    # every key of _Started is popped above (the reaper by _stop_reaper): nothing is left


def _forget_token() -> None:
    """This process forgets the run's token and auth mode (the environment is already
    restored), as Ray's own tests reset them: the configuration first, then the token
    cache. Without it a later ``ray.init()`` of the user's in this process (a
    notebook's) kept presenting the run's token to a cluster of its own and timed out."""
    from ray._raylet import Config  # type: ignore[attr-defined]

    Config.initialize("")
    try:
        from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]
    except ImportError:  # a Ray without token authentication: nothing cached
        return
    AuthenticationTokenLoader.instance().reset_cache()


def _stop_started() -> None:
    """A local start that failed half-way: stop what Ray had started, then forget it."""
    if _STARTED:
        with contextlib.suppress(Exception):  # best effort; the reaper is still there
            ray.shutdown()
    _cleanup_started()


def shutdown_ray() -> None:
    """Disconnect from Ray; a local cluster this process started is stopped and its
    session directory removed."""
    if ray.is_initialized():
        ray.shutdown()
    _cleanup_started()


def gcs_address() -> str:
    """The address of the cluster this process is connected to ("" if none)."""
    if not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().gcs_address)


def kill_actors(actors) -> None:
    """Kill every actor handle given; one already gone is skipped (a pod's shutdown)."""
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor)
