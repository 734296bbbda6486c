"""XLA's TPU flags (``LIBTPU_INIT_ARGS``) a configuration compiles with.

A calibration row is a published run, and a run's XLA flags decide its schedule and so its
peak memory (T2's peak is 50.32 GiB at XLA's defaults, 47.48 GiB with its run's flags). A
configuration of ``configs.yaml`` names its flag set with ``xla_flags``; without one it
compiles with XLA's defaults. No jax here.
"""

from __future__ import annotations

__all__ = ["XLA_FLAG_SETS", "MAXTEXT_2023_LIBTPU_ARGS", "MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS"]

#: XLA's TPU flags MaxText's 2023 runs set (LIBTPU_INIT_ARGS; the [MT-v5p] and [MT-v5e]
#: rows T1-T4, M1, M2: training-steps.md "XLA flags set by these runs"): async collective
#: fusion (also of all-gathers, over several steps), compute / collective overlap on the
#: TensorCore, async all-gathers, the data-parallel all-reduce optimisation.
MAXTEXT_2023_LIBTPU_ARGS = (
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "--xla_tpu_data_parallel_opt_different_sized_ops=true "
    "--xla_tpu_enable_async_collective_fusion=true "
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "--xla_tpu_overlap_compute_collective_tc=true "
    "--xla_enable_async_all_gather=true")

#: XLA's TPU scheduler flags for host offload (LIBTPU_INIT_ARGS beside the above; MaxText's
#: ``benchmarks/xla_flags_library.py`` ``HOST_OFFLOAD_FLAGS`` as recalled; libtpu 0.0.42.1
#: knows every name): the experimental scheduler features, memory-pressure tracking, up to
#: 24 host transfers in flight, the latency-hiding scheduler run again twice. The same ten
#: flags, flag for flag, are the default ``libtpu_init_args`` of MaxText's own
#: ``maxtext/trainers/post_train/distillation/scripts/run_distill_xpk.sh`` (the ``maxtext``
#: 0.2.5 wheel on the package index; there beside a VMEM limit and all-gather backward
#: pipelining, for v7x): the set is MaxText's. That T5's recipe (tpu-recipes-v0.1.4) set
#: them is not in the reference here, so it is not a named set of ``configs.yaml``.
MAXTEXT_HOST_OFFLOAD_LIBTPU_ARGS = (
    " --xla_tpu_enable_all_experimental_scheduler_features=true"
    " --xla_tpu_enable_scheduler_memory_pressure_tracking=true"
    " --xla_tpu_host_transfer_overlap_limit=24"
    " --xla_tpu_aggressive_opt_barrier_removal=ENABLED"
    " --xla_lhs_prioritize_async_depth_over_stall=ENABLED"
    " --xla_should_allow_loop_variant_parameter_in_chain=ENABLED"
    " --xla_should_add_loop_invariant_op_in_chain=ENABLED"
    " --xla_max_concurrent_host_send_recv=100"
    " --xla_tpu_scheduler_percent_shared_memory_limit=100"
    " --xla_latency_hiding_scheduler_rerun=2")

#: ``configs.yaml``'s ``xla_flags`` names -> LIBTPU_INIT_ARGS. Only flag sets a reference
#: gives (training-steps.md) are named here.
XLA_FLAG_SETS: dict[str, str] = {
    "maxtext-2023": MAXTEXT_2023_LIBTPU_ARGS,
}
