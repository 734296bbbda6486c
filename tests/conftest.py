"""Shared fixtures: one local Ray cluster for the whole session; the HLO capture cache in a
temporary directory (a test reads nothing outside the repository, not a user's
``~/.cache/tpu-pod`` either)."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "load: long-run memory test (about a minute); "
                                       "deselect with -m 'not load'")
    config.addinivalue_line("markers", "chaos: seeded kills and SIGTERMs over resumed runs "
                                       "(about a minute per seed); deselect with -m 'not chaos'")


@pytest.fixture(autouse=True, scope="session")
def _capture_cache_of_the_session(tmp_path_factory):
    """``$TPU_POD_CACHE`` (``pod.frontends.jax_capture.cache_dir``) for this session only;
    subprocesses inherit it."""
    import os

    before = os.environ.get("TPU_POD_CACHE")
    os.environ["TPU_POD_CACHE"] = str(tmp_path_factory.mktemp("tpu-pod-cache"))
    yield
    if before is None:
        os.environ.pop("TPU_POD_CACHE", None)
    else:
        os.environ["TPU_POD_CACHE"] = before


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster on 127.0.0.1, shared by every Ray test; yields its address.

    Started as the CLI starts its own (``pod.runtime.cluster``): token
    authentication with a token of this process, which subprocesses inherit
    through the environment (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN_PATH``).
    """
    import ray

    from pod.runtime.cluster import ensure_ray, shutdown_ray

    started = ensure_ray(None)
    yield ray.get_runtime_context().gcs_address
    if started:
        shutdown_ray()
