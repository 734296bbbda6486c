"""A schedule run over real ICI ports in this process, a thread per rank (the tests of
``pod.runtime.ici`` and ``pod.runtime.ici_shm``)."""

from __future__ import annotations

import threading

import numpy as np

from pod.runtime.collective import rank_plans


def run_all(ports, schedule, buffers, run_ids) -> list[np.ndarray]:
    """Run ``schedule`` once per run id over ``ports`` (a thread per rank), each run on the
    previous run's result; every rank's buffer after the last run.

    Raises:
        AssertionError: a rank raised (the errors, listed).
    """
    work = [b.copy() for b in buffers]
    addresses = {r: p.address for r, p in enumerate(ports)}
    errors: list[BaseException] = []

    def rank(r, plan):
        try:
            for run_id in run_ids:
                ports[r].run(run_id, plan, addresses, work[r], schedule.chunk_bounds, timeout=30)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r, plan))
               for r, plan in enumerate(rank_plans(schedule))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return work
