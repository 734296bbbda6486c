"""``Pod``: a training plan's device program on Ray chip actors, one actor per chip.

One step (docs/ARCHITECTURE.md, "One training step"): the driver cuts the
global batch into each device's examples, picks the step's first collective
run id (above every id used before) and makes one call per chip
(``ChipActor.step``); every device runs the program's whole step, its
collectives device to device over its ``IciPort`` (``pod.runtime.ici``); the
driver never holds a parameter or gradient byte. It waits for every chip (a
dead chip's error is the cause if one died) and combines the reports with
the one clock (``pod.runtime.base.PodBase.step``).

The driver never blocks in one long Ray call: every wait is a loop of short
ones (``_POLL_S``), and between two it runs the run's interrupt check (a
SIGINT / SIGTERM is answered within a second whatever the chips do), polls
the chips' heartbeats (``pod.runtime.heartbeat``: a chip whose process stopped
running is declared failed after ``heartbeat_timeout_s``) and, for a step, its
deadline (``STEP_DEADLINE_FACTOR`` times the longest step so far, at least
``STEP_DEADLINE_FLOOR_S``: a chip that runs but never ends its step). Both
raise ``ChipUnresponsiveError``, which the run recovers from like a dead chip.

The pod decides nothing: the program, the collective costs at every step and
the fault plan come from the ``TrainingPlan`` (``pod.config.plan``).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from pod.config.faults import host_chips, host_of
from pod.config.plan import TrainingPlan
from pod.errors import USER_ERRORS, ChipFailureError, ChipUnresponsiveError, ClusterError
from pod.programs import EvalSums
from pod.report.clock import DeviceReport
from pod.runtime.actor import ChipActor
from pod.runtime.admission import ACTOR_CPUS, admit_joined
from pod.runtime.base import PodBase, chip_devices
from pod.runtime.cluster import ensure_ray, kill_actors, shutdown_ray
from pod.runtime.heartbeat import HEARTBEAT_TIMEOUT_S, Heartbeat

__all__ = ["Pod", "RUNS_PER_STEP", "STEP_DEADLINE_FACTOR", "STEP_DEADLINE_FLOOR_S"]

_ACTOR_CPUS = ACTOR_CPUS  # a token CPU share per chip actor; admission checks it
_PLACEMENT_TIMEOUT_S = 60.0
#: run ids per step: a step may issue at most this many collectives per device
RUNS_PER_STEP = 1 << 20
#: how long a failed step waits for the other chips' calls to end (they hold the error
#: of a peer that died: the ICI link closes at once, so this is rarely reached)
_SETTLE_TIMEOUT_S = 5.0
#: wall seconds of one wait inside the driver's loops (signals, heartbeats, deadlines
#: are looked at between two): a fifth of the second a signal may take to be answered
_POLL_S = 0.2
#: a step may take this many times the longest step of the run so far (times the
#: straggler factor in force) before the chips that have not ended it are declared
#: failed: a chip that runs (it answers its heartbeat) but never ends its step, which
#: its peers would otherwise wait for until the collective's own timeout (600 s)
STEP_DEADLINE_FACTOR = 20.0
#: ... and never less than this many wall seconds (a step of milliseconds on a busy
#: machine can take seconds: load average 15-50 on 2 cores here)
STEP_DEADLINE_FLOOR_S = 60.0


class Pod(PodBase):
    """An emulated TPU pod running one training plan on Ray.

    Use as a context manager, or call ``start`` and ``shutdown``.

    Args:
        plan: the checked training plan (``pod.config.plan.build_plan``).
        ray_address: a cluster to join; defaults to the scenario's
            ``ray.address``, then ``RAY_ADDRESS``, then a local cluster.
        heartbeat_timeout_s: wall seconds a chip's process may leave a heartbeat
            unanswered before it is declared frozen (``pod.runtime.heartbeat``).

    Raises:
        ClusterError: Ray could not start, or a chip actor died
            (``ChipFailureError``) or stopped answering (``ChipUnresponsiveError``).
    """

    def __init__(self, plan: TrainingPlan, *, ray_address: str | None = None,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        super().__init__(plan)
        self.ray_address = ray_address or plan.scenario.ray.address
        self.actors: list[Any] = []
        self.placement: Any = None
        # the secret every device of this pod presents on its ICI links (pod/runtime/ici.py)
        self.ici_key = secrets.token_bytes(16)
        self._owns_ray = False
        self._run_base = RUNS_PER_STEP  # run ids of the next step start here
        self._devices = chip_devices(plan)
        # chip actors are named chip-<rank> (``ray list actors``) in a namespace of this
        # pod's own, so two pods on one cluster never collide; a replacement actor is
        # chip-<rank>-restart-<n> (the dead one's name may not be released yet)
        self.namespace = f"tpu-pod-{plan.scenario.name}-{secrets.token_hex(4)}"
        self._restarts: dict[int, int] = {}
        # calls of a failed step still running on stuck chips: read once their actors are
        # replaced, so Ray never prints them as "Unhandled error" stack dumps
        self._unsettled: list[Any] = []
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self._heartbeat: Heartbeat | None = None
        self._check: Callable[[], None] = lambda: None  # the run's interrupt check
        self._longest_step_s = 0.0  # wall seconds of the longest step so far

    # -- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Pod:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def start(self, check: Callable[[], None] | None = None) -> float:
        """Start (or join) Ray and create one actor per chip.

        Args:
            check: the run's interrupt check (it raises to stop the run), called
                once Ray is up, once the hosts are placed, and between the short
                waits of every later wait for the chips (``_wait_ready``), so a
                SIGTERM during start-up or a step stops the run there.

        Returns:
            Wall seconds the actors took to come up.
        """
        check = self._check = check or (lambda: None)
        self._owns_ray = ensure_ray(self.ray_address, dashboard=self.plan.scenario.ray.dashboard)
        check()
        if not self._owns_ray:  # a joined cluster: does it hold the pod? (a local one: admit)
            admit_joined(self.plan, str(self.ray_address or "RAY_ADDRESS"),
                         ray.available_resources())
        t0 = time.perf_counter()
        self.placement = self._place_hosts()
        check()
        self.actors = [self._new_actor(rank) for rank in range(self.plan.topology.chips)]
        self._connect()
        self._slowdowns = {}
        return time.perf_counter() - t0

    def _connect(self) -> None:
        """Tell every chip every device's ICI address (once; again after replacements),
        and start the chips' heartbeat (on each chip's first port)."""
        lists = self._get([a.ici_addresses.remote(self.ici_key) for a in self.actors])
        addresses = {d: tuple(addr) for devices, addrs in zip(self._devices, lists, strict=False)
                     for (d, _), addr in zip(devices, addrs, strict=False)}
        self._get([a.set_peers.remote(addresses) for a in self.actors])
        self._stop_heartbeat()
        self._heartbeat = Heartbeat({rank: tuple(addrs[0]) for rank, addrs in enumerate(lists)},
                                    self.ici_key, timeout_s=self.heartbeat_timeout_s)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None

    def host_of(self, rank: int) -> int:
        """The TPU host a chip belongs to (``pod.config.faults.host_of``: blocks of the
        chip's chips_per_host, never across two slices)."""
        pod = self.plan.topology
        return host_of(rank, pod.chip.chips_per_host, pod.torus.num_chips)

    @functools.cached_property
    def _hosts(self) -> list[list[int]]:
        """The chip ranks of every TPU host, host by host (``pod.config.faults.host_chips``)."""
        pod = self.plan.topology
        return host_chips(pod.chips, pod.chip.chips_per_host, pod.torus.num_chips)

    def _place_hosts(self) -> Any:
        """One placement-group bundle per TPU host, spread over the Ray nodes.

        A bundle lives on one node, so the chips of a host share a node (as the
        chips of a real TPU host share its PCIe and DCN); SPREAD puts hosts on
        different nodes where the cluster has them.
        """
        from ray.util.placement_group import placement_group

        hosts = len(self._hosts)
        group = placement_group([{"CPU": _ACTOR_CPUS * len(ranks)} for ranks in self._hosts],
                                strategy="SPREAD")
        if self._wait_ready([group.ready()], _PLACEMENT_TIMEOUT_S, watch=False):
            raise ClusterError(
                f"ray: could not place {hosts} TPU hosts of "
                f"{self.plan.topology.chip.chips_per_host} "
                f"chips within {_PLACEMENT_TIMEOUT_S:.0f} s; the cluster has "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs")
        return group

    def _new_actor(self, rank: int) -> Any:
        """Start the chip actor of one rank in its host's bundle, named ``chip-<rank>``
        (``chip-<rank>-restart-<n>`` for its n-th replacement) in this pod's namespace."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement,
                                                    placement_group_bundle_index=self.host_of(rank))
        restarts = self._restarts.get(rank, 0)
        name = f"chip-{rank}" + (f"-restart-{restarts}" if restarts else "")
        remote = ray.remote(ChipActor).options(num_cpus=_ACTOR_CPUS, max_concurrency=1,
                                               scheduling_strategy=strategy, name=name,
                                               namespace=self.namespace)
        plan, training = self.plan, self.plan.training
        host = self._hosts[self.host_of(rank)]
        return remote.remote(plan.topology.chip, rank, self._devices[rank], self.program,
                             training.seed, devices_per_chip=plan.mesh.devices_per_chip,
                             precision=training.precision, mxu_model=plan.scenario.pod.mxu_model,
                             activation_bytes=int(plan.memory.get("activations", 0)),
                             cpu_slot=(host.index(rank), len(host)))

    def shutdown(self) -> None:
        """Stop the actors, and the local Ray cluster if this pod started it."""
        self._stop_heartbeat()
        kill_actors(self.actors)
        self.actors = []
        self._settle()
        if self.placement is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.placement)
            except Exception:  # noqa: BLE001 - cluster already gone
                pass
            self.placement = None
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False

    # -- the back-end of PodBase ----------------------------------------------------------

    def _next_runs(self) -> int:
        base = self._run_base
        self._run_base += RUNS_PER_STEP
        return base

    def _per_chip(self, values: Sequence[Any]) -> list[list[Any]]:
        return [[values[d] for d, _ in devices] for devices in self._devices]

    def _step_devices(self, step: int, xs: list[np.ndarray], ys: list[np.ndarray],
                      trace: bool) -> list[DeviceReport]:
        base, seed = self._next_runs(), self.plan.training.seed
        refs = [actor.step_packed.remote(pickle.dumps((step, cx, cy, seed, base, trace),
                                                      protocol=pickle.HIGHEST_PROTOCOL))
                for actor, cx, cy in zip(self.actors, self._per_chip(xs), self._per_chip(ys),
                                         strict=False)]
        t0 = time.monotonic()
        reports = self._get_all(refs, deadline_s=self.step_deadline_s())
        self._longest_step_s = max(self._longest_step_s, time.monotonic() - t0)
        return [r for chip in reports for r in pickle.loads(chip)]

    def step_deadline_s(self) -> float | None:
        """Wall seconds the next step may take before the chips that have not ended it
        are declared failed: ``STEP_DEADLINE_FACTOR`` times the longest step so far
        times the largest straggler factor in force, at least ``STEP_DEADLINE_FLOOR_S``;
        None before the first step ends (its length is unknown: the heartbeat and the
        collectives' own timeout bound it)."""
        if not self._longest_step_s:
            return None
        slowest = max(self._slowdowns.values(), default=1.0)
        return max(STEP_DEADLINE_FLOOR_S,
                   STEP_DEADLINE_FACTOR * self._longest_step_s * max(1.0, slowest))

    def _evaluate_devices(self, xs: list[np.ndarray], ys: list[np.ndarray]) -> list[EvalSums]:
        base = self._next_runs()
        refs = [actor.evaluate.remote(cx, cy, base)
                for actor, cx, cy in zip(self.actors, self._per_chip(xs), self._per_chip(ys),
                                         strict=False)]
        return [s for chip in self._get_all(refs) for s in chip]

    def _snapshot(self, full: Sequence[bool]) -> list[Any]:
        refs = [a.snapshot.remote(f)
                for a, f in zip(self.actors, self._per_chip(full), strict=False)]
        return [s for chip in self._get_all(refs) for s in chip]

    def _load(self, params: dict, opt_state: dict, model_states: Sequence[dict | None]
              ) -> list[tuple[str, str]]:
        refs = (ray.put(params), ray.put(opt_state))
        calls = [a.load.remote(*refs, states)
                 for a, states in zip(self.actors, self._per_chip(model_states), strict=False)]
        return [d for chip in self._get_all(calls) for d in chip]

    def _digests(self) -> list[tuple[str, str]]:
        return [tuple(d) for chip in self._get_all([a.digests.remote() for a in self.actors])
                for d in chip]

    def _set_slowdowns(self, factors: dict[int, float]) -> None:
        self._get_all([self.actors[r].set_compute_slowdown.remote(f) for r, f in factors.items()],
                      ranks=list(factors))

    def shards(self) -> list[Any]:
        """Every device's state (the program's ``DeviceShard``), by device id."""
        return [s for chip in self._get_all([a.shards.remote() for a in self.actors]) for s in chip]

    def node_ids(self) -> list[str]:
        """The Ray node of each chip actor, by rank."""
        return self._get([a.node_id.remote() for a in self.actors])

    # -- faults --------------------------------------------------------------------------

    def kill_chips(self, ranks: Any) -> None:
        """Kill these chips' actors (``ray.kill``, no restart): an injected fault."""
        for r in ranks:
            ray.kill(self.actors[r], no_restart=True)

    def failed_chips(self, timeout_s: float = 10.0) -> tuple[list[int], list[int]]:
        """Which chips a failed step left unusable: a cheap call to each.

        Returns:
            (dead, hung): ranks whose actor is gone (a Ray actor error), and
            ranks that did not answer within ``timeout_s`` (alive but stuck, e.g.
            in a collective waiting for a dead peer's chunks); both need a new
            actor.
        """
        refs = [a.node_id.remote() for a in self.actors]
        pending = set(self._wait_ready(refs, timeout_s, watch=False, fail_fast=False))
        dead, hung = [], []
        for rank, ref in enumerate(refs):
            if ref in pending:
                hung.append(rank)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(rank)
        self._unsettled.extend(pending)  # read once recovery kills their actors
        return dead, hung

    def replace_chips(self, ranks: Any) -> float:
        """Start new actors for these ranks, each in its host's placement-group bundle;
        their state is the initial one until ``restore``.

        Returns:
            Wall seconds until the new actors answered.
        """
        t0 = time.perf_counter()
        self._stop_heartbeat()  # a new one with the new chips' ports (``_connect``)
        for r in ranks:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self.actors[r], no_restart=True)
            self._restarts[r] = self._restarts.get(r, 0) + 1
            self.actors[r] = self._new_actor(r)
            self._slowdowns.pop(r, None)
        self._settle()  # the failed step's calls on the actors just killed
        self._connect()  # the new chips' addresses, to every chip
        return time.perf_counter() - t0

    # -- helpers -------------------------------------------------------------------------

    def _wait_ready(self, refs: Sequence[Any], timeout_s: float | None = None, *,
                    watch: bool = True, fail_fast: bool = True) -> list[Any]:
        """Wait for ``refs`` in short waits (``_POLL_S``) until every one is ready, or
        (``fail_fast``) one that is ready failed, or ``timeout_s`` passed; between two
        waits, the run's interrupt check and (``watch``) the chips' heartbeat.

        Returns:
            The refs not ready, in their order.

        Raises:
            ChipUnresponsiveError: (``watch``) a chip answered no heartbeat for
                ``heartbeat_timeout_s``.
            RunInterrupted: the run's check (a signal whose grace is over).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            wait_s = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait_s <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
            if fail_fast and ready and pending:
                try:
                    ray.get(ready)  # small results, already here
                except ray.exceptions.RayError:
                    break  # a chip failed: its peers may wait for it; the caller reads why
            if pending:
                self._check()
                if watch:
                    self._listen()
        return pending

    def _listen(self) -> None:
        """Poll the chips' heartbeat.

        Raises:
            ChipUnresponsiveError: chips whose process answered no ping for
                ``heartbeat_timeout_s``.
        """
        silent = self._heartbeat.poll() if self._heartbeat is not None else []
        if silent:
            raise ChipUnresponsiveError(
                f"chip actor(s) {', '.join(map(str, silent))} answered no heartbeat for "
                f"{self.heartbeat_timeout_s:g} s (the process does not run: stopped, a frozen "
                f"host or a paused VM?)", silent)

    def _wait(self, refs: Sequence[Any], ranks: Sequence[int] | None = None,
              deadline_s: float | None = None) -> list[Any]:
        """``ray.get(refs)`` that never blocks the driver for long (``_wait_ready``).

        Args:
            refs: one call per chip.
            ranks: the chip of each ref (default: ref i is chip i).
            deadline_s: wall seconds the calls may take.

        Raises:
            ray.exceptions.RayError: a call failed (the first in ``refs``' order).
            ChipUnresponsiveError: a chip's heartbeat went silent, or calls were
                still running at the deadline (their chips).
            RunInterrupted: the run's check.
        """
        if not refs:
            return []
        pending = self._wait_ready(refs, deadline_s)
        left = set(pending)
        done = ray.get([r for r in refs if r not in left])  # raises a failed call's error
        if not pending:
            return done
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        stuck = [rank for rank, ref in zip(ranks, refs, strict=False) if ref in left]
        raise ChipUnresponsiveError(
            f"chip actor(s) {', '.join(map(str, stuck))} did not end the step within "
            f"{deadline_s:.0f} s ({STEP_DEADLINE_FACTOR:g} times the longest step so far, at "
            f"least {STEP_DEADLINE_FLOOR_S:g} s); they still answer their heartbeat: stuck", stuck)

    def _get(self, refs: Any) -> Any:
        """``_wait`` with a chip's failure turned into one clear error."""
        try:
            return self._wait(refs)
        except ray.exceptions.RayError as err:
            raise _chip_error(err) from None

    def _get_all(self, refs: list[Any], ranks: Sequence[int] | None = None,
                 deadline_s: float | None = None) -> list[Any]:
        """Wait for every ref (``_wait``); on a failure, raise once every ref has settled
        or its chip is gone, so no error is left unread and no chip is still
        mid-step: the first dead chip's error if a chip died (its peers' link
        errors follow from it), else the first error in the refs' order. Calls
        left running (a chip declared unresponsive, an interrupted wait, a chip
        stuck past the settling time) are read once recovery or shutdown kills
        their actors (``_settle``)."""
        try:
            return self._wait(refs, ranks, deadline_s)
        except ray.exceptions.RayError as err:
            first = err
        except BaseException:
            self._unsettled.extend(refs)
            raise
        try:  # settle the rest (a chip waiting on a dead peer ends with its IciError)
            pending = set(self._wait_ready(refs, _SETTLE_TIMEOUT_S, watch=False,
                                           fail_fast=False))
        except BaseException:
            self._unsettled.extend(refs)
            raise
        self._unsettled.extend(r for r in refs if r in pending)  # stuck: read once killed
        dead = None
        for ref in refs:
            if ref in pending:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                dead = dead or err
            except ray.exceptions.RayError:
                pass  # read, so Ray does not report it as unhandled
        raise _chip_error(dead or first) from None

    def _settle(self) -> None:
        """Read the calls a failed step left running, once their actors are killed (they
        end at once with the actor's error): an error never read is printed by Ray, when
        its reference goes, as an "Unhandled error" stack dump. Bounded in all by
        ``_SETTLE_TIMEOUT_S``."""
        refs, self._unsettled = list(dict.fromkeys(self._unsettled)), []
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_SETTLE_TIMEOUT_S)
        for ref in ready:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(ref)


def _chip_error(err: Exception) -> Exception:
    """The error a chip's failed call stands for, one line with its cause.

    A user error raised inside an actor (a scenario, chip or interconnect
    error) is itself; a dead actor is a ``ChipFailureError``; any other
    exception keeps its type name and message: ``chip actor failed:
    IciError: chip 2: ...``.
    """
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, USER_ERRORS):
            return cause
        if cause is not None:
            text = (str(cause).strip().splitlines() or [""])[0]
            return ClusterError(f"a chip actor failed: {type(cause).__name__}: {text}")
    if isinstance(err, ray.exceptions.RayActorError):
        return ChipFailureError(f"a chip actor died: {_first_line(err)}")
    return ClusterError(f"a chip actor call failed: {_first_line(err)}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
