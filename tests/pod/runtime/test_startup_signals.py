"""Probe 7 of issue 26: a SIGTERM during a long actor start-up (64 chips) printed Ray's
C++ "*** SIGTERM received ***" stack (absl's failure-signal handler, installed by
``ray.init``) and could abort (exit -6) with no partial summary. The signal is now the
run's: exit 143, one line, a partial summary. One local cluster, 8 chips; the signal
is sent by the run itself while its fifth actor is being created, so the test does
not depend on timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def test_sigterm_while_the_actors_start_is_the_runs_not_rays(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: startup\npod: {chip: v4, chips: 8}\nmodel: {name: mlp, options: "
                        "{hidden: [16]}}\ntraining: {global_batch: 64, steps: 3}\n"
                        "metrics: {port: 0}\n")
    script = textwrap.dedent(f"""
        import os, signal
        from pod.runtime import coordinator
        original = coordinator.Pod._new_actor
        def new_actor(self, rank):
            if rank == 4:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(self, rank)
        coordinator.Pod._new_actor = new_actor
        from pod.cli import main
        main(["run", {str(scenario)!r}, "--output-dir", {str(tmp_path / 'out')!r}])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",
                                                            "RAY_DISABLE_FAILURE_SIGNAL_HANDLER")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 143, (proc.returncode, proc.stderr[-3000:])
    assert "SIGTERM received" not in proc.stderr and "logging.cc" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == \
        ["interrupted by SIGTERM"], proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["completed"] is False and summary["stopped_by"] == "signal SIGTERM"
    assert summary["steps"] == 0
