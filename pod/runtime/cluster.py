"""Start or join the Ray cluster the chip actors run on.

A local cluster is started when no address is given (the scenario's
``ray.address``, else the ``RAY_ADDRESS`` environment variable): bound to
127.0.0.1, dashboard off, token authentication off, logs at ERROR, session
files in Ray's own temporary directory.
"""

from __future__ import annotations

import logging
import os

import ray

from pod.errors import ClusterError

__all__ = ["ensure_ray", "shutdown_ray"]


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Make sure this process is connected to a Ray cluster.

    Args:
        address: an existing cluster to join ("auto", "host:port",
            "ray://..."); None uses ``RAY_ADDRESS`` or starts a local cluster.
        num_cpus: CPUs a local cluster advertises (default: the machine's).

    Returns:
        True if this call started a local cluster (so the caller owns it and
        should shut it down), False if Ray was already up or was joined.

    Raises:
        ClusterError: Ray could not be started or the address not joined.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        if address:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=True)
            return False
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        _loopback_only()
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.ERROR,
            configure_logging=True,
            log_to_driver=False,  # actor errors still arrive as exceptions; no raylet chatter
        )
        return True
    except ClusterError:
        raise
    except Exception as err:  # noqa: BLE001 - Ray raises many kinds; one clear line
        where = f"join the Ray cluster at {address!r}" if address else "start a local Ray cluster"
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ClusterError(f"ray.address: could not {where}: {first}") from None


def _loopback_only() -> None:
    """Keep a local cluster on 127.0.0.1.

    Ray replaces a loopback ``_node_ip_address`` by the machine's address unless
    its "cluster" mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read at
    import time): set it for the processes Ray starts (they inherit the
    environment) and for this one (the constant was read when ray was imported).
    Only for a cluster this process starts: joining a multi-machine cluster
    needs the real address.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def shutdown_ray() -> None:
    """Disconnect from Ray (and stop the local cluster if this process started it)."""
    if ray.is_initialized():
        ray.shutdown()
