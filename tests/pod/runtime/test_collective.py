"""Every collective algorithm over actors holding a buffer (``BufferActor``, on Ray and
in this process), and ``tpu-pod collective``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from interconnect import ALGORITHMS, Torus, build_collective, collective_cost, execute
from pod.cli import cli, main
from pod.commands.collective_bench import bus_factor, parse_size, parse_sizes


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_every_allreduce_algorithm_over_actors_equals_the_numpy_sum():
    import ray

    from pod.runtime.collective import BufferActor, run_schedule, split_chunks

    torus = Torus((2, 2), True)
    remote = ray.remote(BufferActor).options(num_cpus=0)
    actors = [remote.remote(r) for r in range(torus.num_chips)]
    rng = np.random.default_rng(3)
    try:
        for algorithm in ALGORITHMS["allreduce"]:
            buffers = [rng.standard_normal(1001).astype(np.float32) for _ in actors]
            schedule = build_collective("allreduce", torus, 1001, 4, algorithm)
            reference = execute(schedule, buffers)
            total = np.sum(np.stack(buffers).astype(np.float64), axis=0)
            # as built, and with its chunks cut into pieces of at most 100 floats (the
            # pipelined form the pod runs large chunks in): the same bits
            for run in (schedule, split_chunks(schedule, 400)):
                ray.get([a.set_chunk_bounds.remote(run.chunk_bounds) for a in actors])
                ray.get([a.set_buffer.remote(b) for a, b in zip(actors, buffers)])
                done = run_schedule(actors, run)
                assert all(isinstance(ref, ray.ObjectRef) for ref in done)
                ray.get(done)
                results = ray.get([a.get_buffer.remote() for a in actors])
                for got, ref in zip(results, reference):
                    np.testing.assert_array_equal(got, ref, err_msg=algorithm)
                    np.testing.assert_allclose(got, total, rtol=1e-5, atol=1e-5,
                                               err_msg=algorithm)
    finally:
        for actor in actors:
            ray.kill(actor)


class _InProcess:
    """A ``BufferActor`` called like a Ray actor handle (``actor.method.remote(...)``
    runs at once in a thread of this process and returns a future)."""

    def __init__(self, actor, pool):
        self.actor, self.pool = actor, pool

    def __getattr__(self, name):
        method = getattr(self.actor, name)

        class _Remote:
            @staticmethod
            def remote(*args):
                return self.pool.submit(method, *args)

        return _Remote


def test_every_collective_over_buffer_actors_in_process_equals_the_pure_executor():
    """No Ray: the same ``run_schedule`` over ``BufferActor``s in threads of this process
    (their ``IciPort``s on loopback), every algorithm of every op on a 2x3 torus: the
    pure executor's bits."""
    from concurrent.futures import ThreadPoolExecutor

    from pod.runtime.collective import BufferActor, run_schedule

    torus = Torus((2, 3), True)
    rng = np.random.default_rng(5)
    with ThreadPoolExecutor(torus.num_chips) as pool:
        actors = [BufferActor(r, limit_threads=False) for r in range(torus.num_chips)]
        handles = [_InProcess(a, pool) for a in actors]
        addresses = [a.ici_address() for a in actors]
        try:
            for op in ("allreduce", "reduce_scatter", "all_gather"):
                for algorithm in ALGORITHMS[op]:
                    schedule = build_collective(op, torus, 996, 4, algorithm)
                    buffers = [rng.standard_normal(996).astype(np.float32) for _ in actors]
                    for a, b in zip(actors, buffers):
                        a.set_chunk_bounds(schedule.chunk_bounds)
                        a.set_buffer(b)
                    for future in run_schedule(handles, schedule, addresses=addresses):
                        future.result(timeout=60)
                    for a, want in zip(actors, execute(schedule, buffers)):
                        np.testing.assert_array_equal(a.get_buffer(), want,
                                                      err_msg=f"{op} {algorithm}")
        finally:
            for a in actors:
                a.ici_port().close()


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_link_cut_mid_collective_fails_the_receiving_chip_and_drops_its_buffer():
    import ray

    from pod.errors import IciError
    from pod.runtime.collective import BufferActor, run_schedule

    def die_mid_second_chunk(chip):
        """Test-only, run inside chip 0's actor: its first chunk goes out whole; the
        second stops half-way and the link closes, as when the chip dies mid-send."""
        import struct

        port, sent = chip.ici_port(), []
        send = port._send

        def cut(address, chunk, payload):
            if not sent:
                sent.append(address)
                return send(address, chunk, payload)
            sock = port._links.pop(address, None) or port._link(address)
            run_id, phase, seq = chunk  # the wire header <QIIIQ (pod.runtime.ici), inline
            sock.sendall(struct.pack("<QIIIQ", run_id, phase, port.rank, seq, len(payload)))
            sock.sendall(payload[:len(payload) // 2])
            sock.close()
            raise ConnectionError("chip 0 dies mid-chunk (test)")

        port._send = cut

    # ring on 3 chips: chip 0 sends chunk 0 to chip 1 in phase 0, chunk 2 in phase 1
    schedule = build_collective("allreduce", Torus((3,), True), 1200, 4, "ring")
    remote = ray.remote(BufferActor).options(num_cpus=0)
    actors = [remote.remote(r) for r in range(3)]
    try:
        ray.get([a.set_chunk_bounds.remote(schedule.chunk_bounds) for a in actors])
        ray.get([a.set_buffer.remote(np.ones(1200, np.float32)) for a in actors])
        ray.get(actors[0].__ray_call__.remote(die_mid_second_chunk))
        done = run_schedule(actors, schedule)
        with pytest.raises(IciError, match=r"chip 0: phase 1: the link to chip 1 failed while "
                                           r"sending \(ConnectionError: chip 0 dies mid-chunk"):
            ray.get(done[0], timeout=60)
        start, stop = schedule.chunk_bounds[2]
        nbytes = (stop - start) * 4
        with pytest.raises(IciError) as info:
            ray.get(done[1], timeout=60)
        assert str(info.value.cause) == (f"chip 1: phase 1: the link from chip 0 closed mid-chunk "
                                         f"(got {nbytes // 2:,} of {nbytes:,} bytes)")
        # the partly reduced buffer is never read
        with pytest.raises(RuntimeError, match="chip 1: no buffer .*its last collective failed"):
            ray.get(actors[1].get_buffer.remote(), timeout=60)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_rank_plans_carry_no_gradient_bytes_and_cover_every_transfer():
    from pod.runtime.collective import rank_plans

    torus = Torus((2, 2), True)
    for algorithm in ALGORITHMS["allreduce"]:
        schedule = build_collective("allreduce", torus, 1001, 4, algorithm)
        plans = rank_plans(schedule)
        sends = sum(len(s) for plan in plans for _, s, _ in plan)
        receives = sum(len(r) for plan in plans for _, _, r in plan)
        assert sends == receives == sum(len(phase) for phase in schedule.phases)
        # only ints and bools go from the driver to the chips
        flat = repr(plans)
        assert "array" not in flat and "float" not in flat


def test_ici_ports_run_a_schedule_bit_identical_to_execute_and_name_a_dead_peer():

    from pod.runtime.ici import IciError, IciPort
    from tests.pod.runtime.ici_threads import run_all

    torus = Torus((4,), True)
    rng = np.random.default_rng(5)
    for algorithm in ALGORITHMS["allreduce"]:
        schedule = build_collective("allreduce", torus, 1003, 4, algorithm)
        buffers = [rng.standard_normal(1003).astype(np.float32) for _ in range(4)]
        ports = [IciPort(r) for r in range(4)]
        work = run_all(ports, schedule, buffers, [7])
        for got, ref in zip(work, execute(schedule, buffers)):
            np.testing.assert_array_equal(got, ref, err_msg=algorithm)
        for p in ports:
            p.close()
    # only chips that present the pod's link key can deliver chunks
    owner, stranger, peer = IciPort(0, b"pod key"), IciPort(1, b"another key"), IciPort(1, b"pod key")
    plan = [(0, [], [(1, 0, 0, True)])]
    chunk = (3, 0, 0)  # run, phase, sequence
    payload = memoryview(np.ones(4, np.float32)).cast("B")
    try:
        stranger._send(owner.address, chunk, payload)
    except OSError:  # the owner may drop the stranger's connection before it finishes sending
        pass
    with pytest.raises(IciError):
        owner.run(3, plan, {}, np.zeros(4, np.float32), ((0, 4),), timeout=1.5)
    peer._send(owner.address, chunk, payload)
    got = np.zeros(4, np.float32)
    owner.run(3, plan, {}, got, ((0, 4),), timeout=30)
    np.testing.assert_array_equal(got, np.ones(4, np.float32))
    for port in (owner, stranger, peer):
        port.close()
    # a receiver whose sender's link closes fails at once, naming the sender
    a, b = IciPort(0), IciPort(1)
    b._link(a.address)
    b.close()
    plan = [(0, [], [(1, 0, 0, True)])]
    with pytest.raises(IciError, match="from chip 1"):
        a.run(1, plan, {}, np.zeros(4, np.float32), ((0, 4),), timeout=30)
    a.close()


def test_sizes_parse_like_nccl_tests():
    assert parse_size("1KiB") == 1024 and parse_size("64K") == 65536 and parse_size("1MB") == 10**6
    assert parse_sizes("1KiB:8KiB") == [1024, 2048, 4096, 8192]
    assert parse_sizes("4096") == [4096]
    assert bus_factor("allreduce", 16) == pytest.approx(2 * 15 / 16)
    assert bus_factor("all_gather", 16) == pytest.approx(15 / 16)


def test_collective_json_rows_and_best_algorithm_named():
    result = CliRunner().invoke(cli, ["collective", "--chip", "v5e", "--topology", "16",
                                      "--sizes", "1GiB", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.output)
    assert {"size_bytes", "algorithm", "simulated_seconds", "algbw_bytes_per_s",
            "busbw_bytes_per_s"} <= set(row)
    # v5e: an axis of 16 wraps; the bidirectional ring is the best allreduce on a full ring:
    # (n-1)/n x V / W, W = 4.5e10 (tpu-specs.md), at the calibrated rate of a link whose
    # chip drives two links at once (efficiency x 2 ** -exponent), plus the fixed cost
    from interconnect.calibration import CALIBRATION as C

    rate = 4.5e10 * C.efficiency * 2 ** -C.multi_link_exponent
    assert row["algorithm"] in ("bidirectional_ring", "torus")
    assert row["simulated_seconds"] == pytest.approx(15 / 16 * (1 << 30) / rate + C.fixed_s("v5e"),
                                                     rel=0.01)
    assert row["busbw_bytes_per_s"] == pytest.approx(row["algbw_bytes_per_s"] * 30 / 16)


def test_no_wraparound_flag_doubles_the_bandwidth_bound_time():
    def seconds(*flags):
        result = CliRunner().invoke(cli, ["collective", "--chip", "v5e", "--topology", "16",
                                          "--algorithm", "bidirectional_ring", "--sizes", "1GiB",
                                          "--json", *flags])
        return json.loads(result.output)[0]["simulated_seconds"]

    assert seconds("--no-wraparound") / seconds("--wraparound") == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("args, needle", [
    (["--sizes", "12XB"], "size '12XB' is not valid"),
    (["--sizes", "1GiB:1KiB"], "larger than MAX"),
    (["--algorithm", "butterfly"], "expected one of torus, bidirectional_ring"),
    (["--topology", "4x0"], "at least 1 chip"),
])
def test_collective_user_errors_are_one_line(capsys, args, needle):
    base = ["collective", "--chip", "v5e", "--topology", "4x4"]
    argv = base + args if "--topology" not in args else ["collective", "--chip", "v5e", *args]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def _scenario(**pod):
    from pod.config.scenario import parse_scenario

    return parse_scenario({
        "name": "collective-test", "pod": {"slice": "v2-8", **pod},
        "model": {"name": "mlp", "options": {"hidden": [16], "dropout": False}},
        "training": {"global_batch": 64, "steps": 1}, "metrics": {"port": 0},
    })


def test_scenario_chooses_the_algorithm_and_slows_or_fails_links():
    """The plan's allreduce (a data axis over the whole pod): ``auto`` is the fastest,
    a slowed link costs more, a failed one carries no bytes; the data axis's
    collective costs (what a step is charged) follow the same links."""
    from pod.config.plan import build_plan

    auto = build_plan(_scenario())
    tree = build_plan(_scenario(allreduce="tree"))
    assert tree.ici.algorithm == "tree" and auto.ici.algorithm == "torus"
    assert auto.collective_costs.algorithms() == {"data": "torus"}
    assert tree.collective_costs.algorithms() == {"data": "tree"}
    # the data axis spans the pod: its gradient allreduce is the plan's algorithm over the
    # torus, after the on-chip add of the chip's two TensorCores' float32 buffers (v2: read
    # two, write one, at one TensorCore's HBM bandwidth); the mesh costs the bytes in
    # bf16-sized elements, so its chunks round differently (1e-5 here)
    nbytes = 4 * auto.num_params
    on_chip = 3 * nbytes / auto.topology.chip.core.hbm_bandwidth_bytes_per_s
    whole = collective_cost("allreduce", auto.topology.torus, nbytes // 4, auto.ici.link,
                            algorithm="torus")
    assert auto.collective_costs.seconds("data", "allreduce", nbytes) == pytest.approx(
        whole.seconds + on_chip, rel=1e-4)
    assert auto.collective_costs.seconds("data", "allreduce", nbytes) <= \
        tree.collective_costs.seconds("data", "allreduce", nbytes)
    slowed = build_plan(_scenario(allreduce="ring", links=[{"link": "0->1", "slowdown": 4.0}]))
    healthy = build_plan(_scenario(allreduce="ring"))
    assert slowed.collective_costs.seconds("data", "allreduce", nbytes) > \
        healthy.collective_costs.seconds("data", "allreduce", nbytes)
    failed = build_plan(_scenario(allreduce="ring", links=[{"link": "0->1", "failed": True}]))
    assert (0, 1) not in failed.collective_costs.cost("data", "allreduce", nbytes).link_bytes


@pytest.mark.parametrize("pod, needle", [
    ({"allreduce": "butterfly"}, "pod.allreduce"),
    ({"links": [{"link": "0-1", "slowdown": 2.0}]}, "pod.links.0.link"),
    ({"links": [{"link": "0->1"}]}, "slowdown"),
    ({"links": [{"link": "0->1", "slowdown": 0.5}]}, "pod.links.0.slowdown"),
])
def test_bad_collective_keys_are_named(pod, needle):
    from pod.errors import ScenarioError

    with pytest.raises(ScenarioError, match=needle):
        _scenario(**pod)


def test_a_link_the_pod_lacks_is_named():
    from interconnect import TopologyError
    from pod.config.plan import build_plan

    with pytest.raises(TopologyError, match="link 0->3 is not a link of torus 2x2"):
        build_plan(_scenario(links=[{"link": "0->3", "slowdown": 2.0}]))
