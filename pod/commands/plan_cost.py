"""Costing the points of ``tpu-pod plan``: only those the outputs can show, on every core.

Every point is planned (``Planner.point``: the HBM check, the splits; a point that
does not plan is dropped with its reason, as before). A point that plans is
**costed** (one timing-only step) unless a lower bound of its step already puts it
out of what the outputs show, then it is **pruned**:

- The bound is its forward and backward passes' compute: every point of a **class**
  (the same slice, remat policy, per-device batch and mesh but for its data and fsdp
  sizes) runs the same layers on the same per-device shapes, so their passes' records
  are the same (``pod.programs.replay``: the tape replays them from one point to the
  next); the step is at least their compute (``pod.report.clock``: the compute stream
  runs every record), at least their cycle-bound MXU records at the chip's sustained
  budget on one device (``clock.sustained_clocks``), and in a pipeline at least the
  fill before the stage's first op and the drain after its last (``plan_bound``). The
  first point of a class that plans is run (not clocked) and gives the bound of the
  others (``Planner.point``); each later costed one is checked to give the same, else
  the class is not pruned at all.
- What the outputs show: the ``keep`` best points (the table's and layouts.png's)
  and the best point of each mesh family at the global batch of the best point
  (the family lines: ``plan_search.compared_batch``). A point is pruned when its bound
  ranks it below the
  ``keep``-th best costed so far; the points are costed best bound first, so that
  threshold is met early. Then, for each family, the pruned points at the best's
  global batch that could still beat the family's best are costed.

So the table, layouts.png, best.yaml and the family lines are those of costing every
point (tested against ``Planner.cost_alone``); results.csv lists the pruned points
with their bound (``exhaustive`` costs every point).

With ``workers`` > 1 the points are costed by worker processes (``fork``: the workers
start with the planner and its data; a class's points go to the worker that ran its
bound, ``_Runner``; a point's row does not depend on which worker or tape costed it),
in rounds whose composition depends only on the results before them: the same points
are pruned every time. The classes' bounds are one round: each class's points in
search order, up to its first that plans.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pod.commands.plan_search import Candidate
from pod.workloads.remat import remat_effect, twin_policies

__all__ = ["class_key", "cost_points", "default_workers", "Scoring"]

#: points a worker takes at once (a class's points together: they share a tape's passes)
_CHUNK = 8
#: points costed between two updates of the threshold: whatever the workers, so that the
#: same points are pruned with any number of them
_ROUND = 32

_PLANNER: Any = None  # a worker's planner (inherited through fork, or built by _serve)


def default_workers() -> int:
    """Processes that cost points: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def class_key(c: Candidate) -> tuple[Any, ...]:
    """The points whose forward and backward passes are the same: everything of a point
    but its data and fsdp sizes (module docstring)."""
    rest = tuple(sorted((a, s) for a, s in c.mesh.items() if a not in ("data", "fsdp")))
    return (c.slice_name, c.slices, rest, c.remat, c.capacity_factor, c.per_device_batch)


@dataclass(frozen=True)
class Scoring:
    """How points rank (lower is better): minus tokens/s (examples/s without tokens), or
    the simulated seconds to a token budget (``plan._rank``).

    Attributes:
        sequence_length: tokens per example (0: a model without tokens).
        budget: the token budget, or None.
    """

    sequence_length: int
    budget: int | None

    def per_step(self, global_batch: int) -> int:
        """Tokens (examples without tokens) per step."""
        return global_batch * self.sequence_length if self.sequence_length else global_batch

    def score(self, global_batch: int, step_seconds: float) -> float:
        """A point's score from its step."""
        units = self.per_step(global_batch)
        if self.budget:
            return math.ceil(self.budget / units) * step_seconds
        return -units / step_seconds

    def row_score(self, row: dict[str, Any]) -> float:
        return self.score(int(row["global_batch"]), float(row["simulated_step_seconds"]))


def cost_points(planner: Any, points: Sequence[Candidate], *, scoring: Scoring, keep: int,
                family_of: Callable[[dict[str, Any]], str],
                compared_batch: Callable[[list[dict[str, Any]]], int | None],
                exhaustive: bool = False,
                workers: int = 1,
                on_point: Callable[[dict[str, Any], int], None] | None = None,
                round_points: int = _ROUND,
                beside: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Every point's row, in search order (module docstring).

    Args:
        planner: the ``plan.Planner`` of the points' model.
        points: the search's points.
        scoring: how they rank.
        keep: the best points the outputs show (never pruned).
        family_of: a row's mesh family (``plan_search.family``).
        compared_batch: the global batch the families are compared at, of rows
            (``plan_search.compared_batch``).
        exhaustive: cost every point that plans (no pruning).
        workers: processes (1: this one).
        on_point: called with each row as it is made, and the number of points.
        round_points: points costed between two updates of the pruning threshold.
        beside: run in a thread of this process while worker processes cost the points
            (started after they are forked, joined before the rows are returned; not run
            without workers): what this process would do later anyway, such as
            importing the plot's modules. What it raises is dropped.
    """
    with _Runner(planner, workers, on_point, len(points), beside) as runner:
        if exhaustive:
            return runner.run([(c, "cost") for c in points])
        return _Pruner(runner, points, scoring, keep, family_of, compared_batch,
                       round_points).run()


class _Pruner:
    """The rounds of :func:`cost_points` without ``exhaustive``."""

    def __init__(self, runner: _Runner, points: Sequence[Candidate], scoring: Scoring,
                 keep: int, family_of: Callable[[dict[str, Any]], str],
                 compared_batch: Callable[[list[dict[str, Any]]], int | None],
                 round_points: int) -> None:
        self.runner, self.points, self.scoring = runner, list(points), scoring
        self.keep, self.family_of = max(1, int(keep)), family_of
        self.compared_batch = compared_batch
        self.rows: dict[int, dict[str, Any]] = {}
        self.passes: dict[Any, float | None] = {}  # class -> its passes' seconds (None: unsure)
        self.round = max(1, int(round_points))

    def run(self) -> list[dict[str, Any]]:
        self._bounds()
        rest = sorted((c for c in self.points if self.passes.get(class_key(c))
                       and self.rows.get(c.index, {}).get("status", "pruned") == "pruned"),
                      key=self._bound)
        while rest and self._bound(rest[0]) <= self._threshold():
            threshold = self._threshold()
            cut = next((i for i, c in enumerate(rest) if self._bound(c) > threshold), len(rest))
            self._run([(c, "cost") for c in rest[:min(cut, self.round)]])
            rest = rest[min(cut, self.round):]
        self._run([(c, "plan") for c in rest if c.index not in self.rows])
        self._families()
        self._unsure()
        self._reasons()
        return [self.rows[c.index] for c in self.points]

    def _bounds(self) -> None:
        """Each class's passes' seconds: its first point that plans, run but not clocked
        (one round: a class's points are given together in search order, those before it
        dropped, those after it left for later; a class whose points all drop has none)."""
        self._run([(c, "first") for c in self.points])

    def _run(self, tasks: list[tuple[Candidate, str]]) -> None:
        for (c, _), result in zip(tasks, self.runner.run_bounded(tasks), strict=True):
            if result is None:  # a "first" task after its class's first point that plans
                continue
            row, seconds = result
            self.rows[c.index] = row
            if seconds is None:
                continue
            key = class_key(c)
            if key not in self.passes:
                self.passes[key] = seconds
            elif self.passes[key] != seconds:  # not one class after all: prune none of it
                self.passes[key] = None

    def _bound(self, c: Candidate) -> float:
        """The best score a point of a class with known passes can have (-inf: unknown)."""
        seconds = self.passes.get(class_key(c))
        if not seconds:
            return -math.inf
        return self.scoring.score(c.global_batch, seconds)

    def _threshold(self) -> float:
        """The ``keep``-th best score costed so far (inf while fewer are)."""
        scores = sorted(self.scoring.row_score(r) for r in self.rows.values()
                        if r["status"] == "ok")
        return scores[self.keep - 1] if len(scores) >= self.keep else math.inf

    def _pruned(self) -> list[Candidate]:
        return [c for c in self.points if self.rows[c.index]["status"] == "pruned"]

    def _families(self) -> None:
        """Cost the pruned points of each family at the batch families are compared at
        that could beat the family's best costed there."""
        batch = self.compared_batch(list(self.rows.values()))
        while True:
            ok = [r for r in self.rows.values() if r["status"] == "ok"]
            if not ok or batch is None:
                return
            best: dict[str, float] = {}
            for r in ok:
                if r["global_batch"] == batch:
                    f = self.family_of(r)
                    best[f] = min(best.get(f, math.inf), self.scoring.row_score(r))
            tasks = sorted((c for c in self._pruned() if c.global_batch == batch
                            and self._bound(c) < best.get(self.family_of(self.rows[c.index]),
                                                          math.inf)), key=self._bound)
            if not tasks:
                return
            self._run([(c, "cost") for c in tasks[:self.round]])

    def _unsure(self) -> None:
        """Cost the pruned points of a class found not to be one (its bound unsure)."""
        tasks = [(c, "cost") for c in self._pruned() if self.passes.get(class_key(c)) is None]
        if tasks:
            self._run(tasks)

    def _reasons(self) -> None:
        """Each pruned point's reason: its bound against the ``keep``-th best."""
        threshold = self._threshold()
        for c in self._pruned():
            bound, seconds = self._bound(c), self.passes[class_key(c)] or 0.0
            if self.scoring.budget:
                what = (f"at least {bound:,.0f} s to the budget, more than the "
                        f"{self.keep}th fastest's {threshold:,.0f} s")
            else:
                unit = "tokens/s" if self.scoring.sequence_length else "examples/s"
                what = (f"at most {-bound:,.0f} {unit}, below the {self.keep}th fastest's "
                        f"{-threshold:,.0f}")
            fill = " and the pipeline's fill and drain" if c.mesh.get("stage", 1) > 1 else ""
            self.rows[c.index]["reason"] = (
                f"not costed: its forward and backward passes{fill} take at least "
                f"{seconds * 1e3:,.1f} ms a step ({what}); --exhaustive costs it")


class _Runner:
    """Runs points in this process or in worker processes; rows come back in the order
    given.

    The workers are forked with the planner (spawned where fork is not offered: each
    builds the planner of the model's source). A class's points (and its twins', one
    group: ``_group_key``) go to the worker that first took the group, so that its
    bound's run (``Planner.point`` keeps it to cost the point later), its twin's step and
    its passes on the worker's tape are found there; an idle worker whose own groups are
    done takes a new group, or the last chunk of another worker's (whichever worker
    costs a point, its row is the same).
    """

    def __init__(self, planner: Any, workers: int, on_point, total: int,
                 beside: Callable[[], None] | None = None) -> None:
        self.planner, self.on_point, self.total = planner, on_point, total
        self.workers = max(1, int(workers))
        self.processes: list[Any] = []
        self.pipes: list[Any] = []
        self.owner: dict[Any, int] = {}  # group -> the worker that takes its points
        self.beside = beside
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _Runner:
        if self.workers > 1:
            global _PLANNER
            if "fork" in multiprocessing.get_all_start_methods():
                _PLANNER = self.planner  # the workers start with the planner, data and model
                context: Any = multiprocessing.get_context("fork")
                init = None
            else:
                context = multiprocessing.get_context("spawn")
                init = (type(self.planner), self.planner.source)
            for _ in range(self.workers):
                mine, theirs = context.Pipe()
                process = context.Process(target=_serve, args=(theirs, init), daemon=True)
                process.start()
                theirs.close()
                self.processes.append(process)
                self.pipes.append(mine)
            if self.beside is not None:  # after the forks: a fork copies no running thread
                self.thread = threading.Thread(target=_quietly, args=(self.beside,),
                                               daemon=True)
                self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            if exc[0] is None:
                pipe.send(None)  # done
            else:
                process.terminate()
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            process.join()
            pipe.close()
        if self.thread is not None:
            self.thread.join()

    def run(self, tasks: list[tuple[Candidate, str]]) -> list[dict[str, Any]]:
        return [result[0] for result in self.run_bounded(tasks) if result is not None]

    def run_bounded(self, tasks: list[tuple[Candidate, str]]
                    ) -> list[tuple[dict[str, Any], float | None] | None]:
        """Each task's (row, passes' seconds), in the order given (a task: a point and
        ``Planner.point``'s mode, or "first": bound mode unless a point of its class
        before it in the tasks planned, else None: the tasks of a class in search
        order find its first point that plans)."""
        if not self.processes:
            out = []
            for _, result in _execute(self.planner, enumerate(tasks)):
                out.append(result)
                if result is not None:
                    self._report(result[0])
            return out
        done: dict[int, tuple[dict[str, Any], float | None] | None] = {}
        for results in self._dispatch(_chunks(list(enumerate(tasks)))):
            for i, result in results:
                done[i] = result
                if result is not None:
                    self._report(result[0])
        return [done[i] for i in range(len(tasks))]

    def _dispatch(self, chunks: list[list[tuple[int, tuple[Candidate, str]]]]
                  ) -> Iterator[list[tuple[int, Any]]]:
        """The chunks run by the workers, a chunk at a time each (module docstring); each
        chunk's results as it ends."""
        mine: list[list[Any]] = [[] for _ in self.pipes]
        new: list[list[tuple[int, tuple[Candidate, str]]]] = []
        for chunk in chunks:
            owner = self.owner.get(_group_key(chunk[0][1][0]))
            (new if owner is None else mine[owner]).append(chunk)
        new.reverse()  # taken from the end: in the order given
        for queue in mine:
            queue.reverse()
        busy: dict[int, Any] = {}
        while busy or new or any(mine):
            for w, pipe in enumerate(self.pipes):
                if w in busy:
                    continue
                if mine[w]:
                    chunk = mine[w].pop()
                elif new:
                    chunk = new.pop()
                    self.owner[_group_key(chunk[0][1][0])] = w
                else:
                    other = max(range(len(mine)), key=lambda v: len(mine[v]))
                    if not mine[other]:
                        continue
                    chunk = mine[other].pop(0)  # the last it would take
                pipe.send(chunk)
                busy[w] = pipe
            for ready in multiprocessing.connection.wait(list(busy.values())):
                w = self.pipes.index(ready)
                del busy[w]
                ok, results = self.pipes[w].recv()
                if not ok:
                    raise results
                yield results

    def _report(self, row: dict[str, Any]) -> None:
        if self.on_point is not None:
            self.on_point(row, self.total)


def _group_key(c: Candidate) -> tuple[Any, ...]:
    """A point's class, twin remat policies as one (``remat_effect``): points a worker
    should take together (they share passes, and a twin's step)."""
    key = class_key(c)
    if c.remat in twin_policies():
        return (*key[:3], remat_effect(c.remat), *key[4:])
    return key


def _chunks(tasks: list[tuple[int, tuple[Candidate, str]]]
            ) -> list[list[tuple[int, tuple[Candidate, str]]]]:
    """Tasks in chunks of at most ``_CHUNK``, a class's (and its twins') together; a
    group's "first" tasks all in one chunk, each class's in the order given."""
    by_class: dict[Any, list[tuple[int, tuple[Candidate, str]]]] = {}
    for item in tasks:
        by_class.setdefault(_group_key(item[1][0]), []).append(item)
    out: list[list[tuple[int, tuple[Candidate, str]]]] = []
    for items in by_class.values():  # a point beside its twin (the same mesh)
        items.sort(key=lambda item: (sorted(item[1][0].mesh.items()), item[0]))
        firsts = [item for item in items if item[1][1] == "first"]
        if firsts:
            out.append(sorted(firsts))  # in the order given
        rest = [item for item in items if item[1][1] != "first"]
        out.extend(rest[i:i + _CHUNK] for i in range(0, len(rest), _CHUNK))
    return out


def _execute(planner: Any, tasks: Iterable[tuple[int, tuple[Candidate, str]]]
             ) -> Iterator[tuple[int, tuple[dict[str, Any], float | None] | None]]:
    """Each task's (index, ``Planner.point``'s row and passes' seconds), as it is run; a
    "first" task runs in bound mode unless a point of its class before it planned (its
    passes known), else gives None."""
    found: set[Any] = set()  # classes whose first point that plans was run
    for i, (c, mode) in tasks:
        if mode != "first":
            yield i, planner.point(c, mode=mode)
            continue
        key = class_key(c)
        if key in found:
            yield i, None
            continue
        result = planner.point(c, mode="bound")
        if result[1] is not None:
            found.add(key)
        yield i, result


def _quietly(run: Callable[[], None]) -> None:
    """``run()``, whatever it raises dropped (``cost_points``'s ``beside``)."""
    with contextlib.suppress(Exception):  # a head start only: the real call raises it again
        run()


def _serve(pipe: Any, init: tuple[Any, Any] | None) -> None:
    """A worker: chunks of tasks from ``pipe`` until None, each answered with (True, its
    results) or (False, the exception it raised). ``init``: (the planner's class, the
    model's source) to build the planner from (spawned), or None (forked with it)."""
    global _PLANNER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends the workers on ^C
    if init is not None:
        _PLANNER = init[0](init[1])
    while True:
        chunk = pipe.recv()
        if chunk is None:
            return
        try:
            pipe.send((True, list(_execute(_PLANNER, chunk))))
        except Exception as err:  # noqa: BLE001 - raised again in the parent
            pipe.send((False, err))
