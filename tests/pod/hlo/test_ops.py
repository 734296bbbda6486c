"""What an HLO op costs (``pod.hlo.ops``) against the chip model's functions called directly."""

from __future__ import annotations

import math

import pytest

from chip import TensorCore, get_chip_spec
from pod.config.slices import resolve_pod
from pod.errors import HloOpError
from pod.hlo import cost_module, parse_hlo
from pod.hlo.ops import XLA_ESTIMATE_SUFFIX, OpCoster, gemm_dims, instruction_of, short_name
from pod.report.clock import sustained_mxu_fraction

V5E = get_chip_spec("v5e").core


def one_op(body: str, params: str = "a: bf16[256,512]",
           args: str = "  %a = bf16[256,512]{1,0} parameter(0)") -> str:
    return f"""HloModule one, is_scheduled=true
ENTRY %main ({params}) -> bf16[256,512] {{
{args}
{body}
}}
"""


def cost(text: str, sustained: bool = False):
    return cost_module(parse_hlo(text), resolve_pod(slice_name="v5e-1"), sustained=sustained)


def core(sustained: bool = False) -> TensorCore:
    return TensorCore(V5E, numerics=False, execute=False, sustained=sustained)


def test_a_matmul_is_account_matmul():
    """A bf16 dot with its operands and result in HBM: the cost of
    ``TensorCore.account_matmul`` of its M, K, N."""
    text = """HloModule mm, is_scheduled=true
ENTRY %main (a: bf16[2048,4096], w: bf16[4096,1024]) -> bf16[2048,1024] {
  %a = bf16[2048,4096]{1,0} parameter(0)
  %w = bf16[4096,1024]{1,0} parameter(1)
  ROOT %d = bf16[2048,1024]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    for sustained in (False, True):
        step = cost(text, sustained)
        want = core(sustained).account_matmul(2048, 4096, 1024)
        assert want.bound != "memory"
        # a training step of matmuls alone runs at the chip's sustained rate e1, its op at a
        # fresh op's e0 (pod.report.clock.sustained_clocks); a benchmarked op as it is
        seconds = want.seconds / (sustained_mxu_fraction(V5E) if sustained else 1.0)
        assert step.step_seconds == pytest.approx(seconds, rel=1e-12)
        assert step.ops[0].seconds == pytest.approx(want.seconds, rel=1e-12)
        assert step.flops_per_device == want.flops
        assert step.stats.compute_bound_seconds == {"mxu": pytest.approx(seconds)}


@pytest.mark.parametrize("rows", [64, 65536])
def test_a_training_step_is_held_to_the_sustained_mxu_budget(rows):
    """The chip's sustained budget binds a step as it binds the built-in path's
    (``sustained_clocks``): a step takes at least its MXU-bound seconds over e1 / e0;
    with enough HBM-bound work beside its matmuls (65536 rows) it is not slowed."""
    text = f"""HloModule mm, is_scheduled=true
ENTRY %main (a: bf16[2048,4096], w: bf16[4096,1024], v: f32[{rows},4096]) -> f32[{rows},4096] {{
  %a = bf16[2048,4096]{{1,0}} parameter(0)
  %w = bf16[4096,1024]{{1,0}} parameter(1)
  %d = bf16[2048,1024]{{1,0}} dot(%a, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  %v = f32[{rows},4096]{{1,0}} parameter(2)
  ROOT %n = f32[{rows},4096]{{1,0}} negate(%v)
}}
"""
    step = cost(text, sustained=True)
    mxu = core(True).account_matmul(2048, 4096, 1024).seconds
    serial = sum(op.seconds for op in step.ops)
    assert step.step_seconds == pytest.approx(max(serial, mxu / sustained_mxu_fraction(V5E)),
                                              rel=1e-9)
    assert (step.step_seconds > serial) == (rows == 64)


def test_the_committed_tpu_matmul(modules):
    """XLA prefetched one operand into VMEM across program runs: the fusion reads the
    other and writes its result (account_kernel with those bytes)."""
    step = cost_module(modules[("matmul", "tpu")], resolve_pod(slice_name="v5e-1"),
                       sustained=False)
    want = core().account_kernel("mm", [(512, 1024, 256, 1)], (1024 * 256 + 512 * 256) * 2)
    assert step.step_seconds == pytest.approx(want.seconds, rel=1e-12)


def test_gemm_dims_of_dots_and_windowed_convolutions(modules):
    """Every MXU op of the TPU-compiled MLP: the FLOPs the HLO walks to equal the model's by
    hand. Per device a layer's forward is 2 products of 32 x 256 x 256 (the batch 2 ways,
    the MLP 4 ways); backward twice that; 3 layers."""
    step = cost_module(modules[("mlp_scan", "tpu")], resolve_pod(slice_name="v5e-8"))
    assert step.flops_per_device == 3 * 3 * 2 * (2 * 32 * 256 * 256)
    cpu = cost_module(modules[("mlp_scan", "cpu")], resolve_pod(slice_name="v5e-8"),
                      approximate=True)
    assert cpu.flops_per_device == step.flops_per_device


def test_conv_with_padding_counts_only_real_taps():
    text = """HloModule c, is_scheduled=true
ENTRY %main (x: bf16[2,512,1024,1], w: bf16[1024,4,128,1]) -> bf16[2,512,4,128] {
  %x = bf16[2,512,1024,1]{3,2,1,0} parameter(0)
  %w = bf16[1024,4,128,1]{3,2,1,0} parameter(1)
  ROOT %c = bf16[2,512,4,128]{3,2,1,0} convolution(%x, %w), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}
"""
    module = parse_hlo(text)
    entry = module.entry_computation
    m, k, n, batch = gemm_dims(entry.root, {i.name: i.shape for i in entry.instructions})
    # XLA's einsum btd,dhk->bthk over a window: each output reads one real tap of 1024
    assert (m * k * n * batch) == 2 * 512 * 4 * 128 * 1024
    # ... and the heads are the GEMM's columns, as the dot's (bt) x d x (h k)
    assert (m, k, n, batch) == (2 * 512, 1024, 4 * 128, 1)


def test_a_dot_written_as_a_convolution_over_the_heads_costs_the_dot():
    """XLA TPU writes some projections bte,end->btnd as a convolution whose window walks
    the heads (one input position, padded H - 1 both sides, the kernel reversed): each
    output head reads its own tap. On v6e's 256-wide MXU an N of one head (128) would run
    at half rate; the dot it is costs the chip model's GEMM of M = b t, K = e,
    N = heads x head dimension."""
    conv = """HloModule c, is_scheduled=true
ENTRY %main (x: bf16[2,2048,1024,1], w: bf16[1024,8,128,1]) -> bf16[2,2048,8,128] {
  %x = bf16[2,2048,1024,1]{3,2,1,0} parameter(0)
  %w = bf16[1024,8,128,1]{3,2,1,0} parameter(1)
  ROOT %c = bf16[2,2048,8,128]{3,2,1,0} convolution(%x, %w), window={size=1x8 pad=0_0x7_7 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f
}
"""
    v6e = get_chip_spec("v6e").core
    step = cost_module(parse_hlo(conv), resolve_pod(slice_name="v6e-1"), sustained=False)
    m, k, n = 2 * 2048, 1024, 8 * 128
    want = TensorCore(v6e).account_kernel("mm", [(m, k, n, 1)], (m * k + k * n + m * n) * 2)
    assert step.flops_per_device == 2 * m * k * n
    assert step.step_seconds == pytest.approx(want.seconds, rel=1e-9)
    narrow = TensorCore(v6e).account_kernel("mm", [(m * 8, k, 128, 1)], 0)
    assert narrow.mxu_cycles > 1.5 * want.mxu_cycles  # what one head's N cost before


def test_an_elementwise_fusion_is_account_vector():
    text = """HloModule e, is_scheduled=true
%f (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %e = f32[1024,1024]{1,0} exponential(%p)
  %c = f32[] constant(2)
  %b = f32[1024,1024]{1,0} broadcast(%c), dimensions={}
  ROOT %m = f32[1024,1024]{1,0} multiply(%e, %b)
}
ENTRY %main (a: f32[1024,1024]) -> f32[1024,1024] {
  %a = f32[1024,1024]{1,0} parameter(0)
  ROOT %fu = f32[1024,1024]{1,0} fusion(%a), kind=kLoop, calls=%f
}
"""
    n = 1024 * 1024
    ops = n * V5E.transcendental_cycles_per_element_op + n       # exp weighted, multiply
    want = core().account_vector("f", n, 2 * 4 * n, ops_per_element=ops / n)
    assert cost(text).step_seconds == pytest.approx(want.seconds, rel=1e-12)


def test_sliced_parameters_and_in_place_updates_move_only_their_part():
    text = """HloModule s, is_scheduled=true
%f (big: f32[64,1024], i: s32[], upd: f32[1,1024]) -> f32[64,1024] {
  %big = f32[64,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %upd = f32[1,1024]{1,0} parameter(2)
  %z = s32[] constant(0)
  ROOT %d = f32[64,1024]{1,0} dynamic-update-slice(%big, %upd, %i, %z)
}
ENTRY %main (big: f32[64,1024], u: f32[1,1024]) -> f32[64,1024] {
  %big = f32[64,1024]{1,0} parameter(0)
  %u = f32[1,1024]{1,0} parameter(1)
  %i = s32[] constant(3)
  ROOT %fu = f32[64,1024]{1,0} fusion(%big, %i, %u), kind=kLoop, calls=%f
}
"""
    module = parse_hlo(text)
    coster = OpCoster(module, V5E)
    entry = module.entry_computation
    assert coster._hbm_bytes(entry, entry.root) == 4 + 1024 * 4 + 1024 * 4  # index, read, write


def test_a_window_sliced_in_a_nested_fusion_moves_only_the_window():
    """XLA TPU's windowed collective matmuls slice each step's window out of the whole
    activation inside a fusion nested in the kernel (padded first, to take a window across
    the ring's two directions): the kernel reads the window, not the activation. Here a
    (16, 1, 1024) buffer padded to (16, 2, 1024) and sliced (16, 2, 128) reads its
    16 x 1 x 128 real elements; a (64, 1024) buffer sliced (64, 128) in a nested fusion reads
    64 x 128."""
    text = """HloModule w, is_scheduled=true
%window (i: s32[], x: bf16[16,1,1024], y: bf16[64,1024]) -> bf16[64,256] {
  %x = bf16[16,1,1024]{2,1,0} parameter(1)
  %inf = bf16[] constant(-inf)
  %p = bf16[16,2,1024]{2,1,0} pad(%x, %inf), padding=0_0x0_1x0_0
  %i = s32[] parameter(0)
  %z = s32[] constant(0)
  %ds = bf16[16,2,128]{2,1,0} dynamic-slice(%p, %z, %z, %i), dynamic_slice_sizes={16,2,128}
  %b = bf16[32,128]{1,0} bitcast(%ds)
  %y = bf16[64,1024]{1,0} parameter(2)
  %dy = bf16[64,128]{1,0} dynamic-slice(%y, %z, %i), dynamic_slice_sizes={64,128}
  %c = bf16[96,128]{1,0} concatenate(%b, %dy), dimensions={0}
  ROOT %r = bf16[64,256]{1,0} bitcast(%c)
}
%kernel (x: bf16[16,1,1024], i: s32[], y: bf16[64,1024], w: bf16[256,512]) -> bf16[64,512] {
  %x = bf16[16,1,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %y = bf16[64,1024]{1,0} parameter(2)
  %win = bf16[64,256]{1,0} fusion(%i, %x, %y), kind=kLoop, calls=%window
  %w = bf16[256,512]{1,0} parameter(3)
  ROOT %d = bf16[64,512]{1,0} dot(%win, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
ENTRY %main (x: bf16[16,1,1024], y: bf16[64,1024], w: bf16[256,512]) -> bf16[64,512] {
  %x = bf16[16,1,1024]{2,1,0} parameter(0)
  %y = bf16[64,1024]{1,0} parameter(1)
  %w = bf16[256,512]{1,0} parameter(2)
  %i = s32[] constant(3)
  ROOT %f = bf16[64,512]{1,0} fusion(%x, %i, %y, %w), kind=kOutput, calls=%kernel
}
"""
    module = parse_hlo(text)
    entry = module.entry_computation
    window = 16 * 1 * 128 * 2 + 64 * 128 * 2
    want = window + 4 + 256 * 512 * 2 + 64 * 512 * 2  # windows, index, weights, result
    assert OpCoster(module, V5E)._hbm_bytes(entry, entry.root, mxu=True) == want


def test_vmem_buffers_are_not_hbm_traffic():
    text = one_op("  ROOT %n = bf16[256,512]{1,0:T(8,128)S(1)} negate(%a)",
                  args="  %a = bf16[256,512]{1,0:T(8,128)S(1)} parameter(0)")
    step = cost(text)
    assert step.ops[0].hbm_bytes == 0 and step.ops[0].bound == "vpu"


def test_an_unknown_op_takes_xlas_estimate_or_is_refused():
    est = one_op('  ROOT %t = bf16[256,512]{1,0} triangular-solve(%a, %a), '
                 'backend_config={"estimated_cycles":"9400"}')
    step = cost(est)
    assert step.step_seconds == pytest.approx(9400 / V5E.clock_hz)
    assert step.ops[0].how == "XLA estimate"
    with pytest.raises(HloOpError, match=r"^line 4: triangular-solve 't' has no cost model"):
        cost(one_op("  ROOT %t = bf16[256,512]{1,0} triangular-solve(%a, %a)"))


def test_a_record_name_leads_back_to_its_instruction():
    """The trace names each kernel by ``short_name`` (with the XLA-estimate suffix where
    XLA's cycles cost it); ``instruction_of`` finds the instruction again, so the trace's op
    events get the user's op name and source (``pod.hlo.report``) for every kernel."""
    module = parse_hlo(one_op('  ROOT %t = bf16[256,512]{1,0} triangular-solve(%a, %a), '
                              'metadata={op_name="jit(f)/solve [x]"}'))
    instr = module.entry_computation.root
    assert short_name(instr) == "jit(f)/solve [x] [t]"
    assert instruction_of(short_name(instr)) == "t"
    assert instruction_of(short_name(instr) + XLA_ESTIMATE_SUFFIX) == "t"
    assert instruction_of("allreduce") == ""


def test_a_cpu_dot_runs_as_the_tpu_runs_it():
    """Approximate (CPU-compiled): a float32 dot costs the bf16 product (one MXU pass, bf16
    bytes); its element-wise consumer is its epilogue, adding no HBM bytes."""
    text = """HloModule cpu, is_scheduled=true
ENTRY %main (a: f32[1024,2048], w: f32[2048,512]) -> f32[1024,512] {
  %a = f32[1024,2048]{1,0} parameter(0)
  %w = f32[2048,512]{1,0} parameter(1)
  %d = f32[1024,512]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = f32[1024,512]{1,0} maximum(%d, %d)
}
"""
    step = cost_module(parse_hlo(text), resolve_pod(slice_name="v5e-1"), approximate=True,
                       sustained=False)
    tc = core()
    want = tc.account_matmul(1024, 2048, 512)
    fused = tc.account_vector("max", 1024 * 512, 0, fused="previous")
    assert step.step_seconds == pytest.approx(want.seconds + fused.seconds, rel=1e-12)
    assert [r.how for r in step.ops] == ["mxu"]
    assert math.isclose(step.flops_per_device, want.flops)


def test_flash_kernels_take_the_projects_kernel_model():
    """A Pallas flash-attention custom call: forward, and the backward's dkv kernel named as
    jax names them, costed by pod.workloads.flash on q (B, H, T, Dh) and k (B, K, T, Dh)."""
    from pod.workloads.flash import record_flash_backward_kernel, record_flash_forward

    def kernel(name: str) -> str:
        return f"""HloModule f, is_scheduled=true
ENTRY %main (q: bf16[2,4,1024,128], k: bf16[2,4,1024,128]) -> bf16[2,4,1024,128] {{
  %q = bf16[2,4,1024,128]{{3,2,1,0}} parameter(0)
  %k = bf16[2,4,1024,128]{{3,2,1,0}} parameter(1)
  ROOT %{name} = bf16[2,4,1024,128]{{3,2,1,0}} custom-call(%q, %k, %k), custom_call_target="tpu_custom_call"
}}
"""
    for name, record in (
            ("flash_attention.3", lambda c: record_flash_forward(c, "f", 2, 4, 4, 1024, 128)),
            ("flash_mha_bwd_dkv_block_q_major_256_block_k_major_512", lambda c:
             record_flash_backward_kernel(c, "f", "dkv", 2, 4, 4, 1024, 128, 256, 512))):
        tc = core(True)
        record(tc)
        want = sum(r.seconds for r in tc.take_records())
        step = cost(kernel(name), sustained=True)
        assert step.ops[0].seconds == pytest.approx(want, rel=1e-12)  # the kernel, at e0
        assert step.ops[0].how == "flash kernel model"


def test_buffers_an_async_collective_carries_through_a_kernel_are_not_its_traffic(modules):
    """XLA TPU's async collective fusions pass the all-gather's buffers through the compute
    kernels between start and done; the kernels' HBM bytes are their own operands only."""
    module = modules[("fsdp_block", "tpu")]
    coster = OpCoster(module, V5E)
    carried = 0
    for comp, instr in module.instructions():
        if instr.opcode != "fusion" or not instr.attrs.get("calls", "").startswith(
                "%async_collective_fusion"):
            continue
        called = module.computations[instr.called[0]]
        gathered = {p.name for p in called.instructions if p.opcode == "all-gather"}
        assert gathered
        total = coster._hbm_bytes(comp, instr, mxu=True)
        whole = sum(comp.by_name[o].shape.hbm_bytes() for o in instr.operands) \
            + instr.shape.hbm_bytes()
        assert total < whole
        carried += 1
    assert carried
