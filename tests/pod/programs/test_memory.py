"""What a device program reports it holds in HBM (``DeviceProgram.memory``), item by item
against hand counts: the sharded transformer's parameters, gradients, optimizer state and
kept activations, its workspace by phase (the gathered weights and the prefetched ones,
the logits, the copy of the weights in the compute dtype), the replicated program's, and
the pipeline's stages."""

from __future__ import annotations

import math

import pytest

from pod.memory import DeviceMemory
from pod.programs import PipelinedTransformer, ReplicatedProgram, ShardedTransformer
from pod.programs.memory import (
    DOT_PRODUCT_LIVE_SCORES,
    backward_working_bytes,
    recomputed_attention_elements,
)
from pod.workloads import build_model, build_optimizer

T, C, H, KV, DH, F, V = 16, 16, 4, 2, 4, 32, 40


def tiny(vocabulary=V, layers=2, **options):
    return build_model("transformer", (T,), vocabulary, embed_dim=C, heads=H, kv_heads=KV,
                       head_dim=DH, mlp_dim=F, layers=layers, **options)


def sharded(model, optimizer="adamw", **sizes):
    return ShardedTransformer(model, sizes, build_optimizer(optimizer))


def block_params(tensor=1):
    """One block's parameters on one of ``tensor`` devices: two RMSNorm scales, q, k, v,
    out and a gated MLP's wi_0, wi_1, wo, the heads and hidden units split."""
    inner, kv, f = H * DH // tensor, KV * DH // tensor, F // tensor
    return 2 * C + C * (inner + 2 * kv) + inner * C + 3 * C * f


@pytest.mark.parametrize("fsdp, tensor", [(1, 1), (2, 1), (4, 2), (3, 1)])
def test_the_state_is_the_devices_chunks_with_the_tables_split_over_tensor(fsdp, tensor):
    """Parameters (float32), gradients (float32, in backward) and AdamW's two moments of
    the chunks the program cuts (``shard_params``: padding included), but the vocabulary
    tables (token embedding; the untied output kernel) split over tensor as MaxText's
    ``vocab`` rule splits them on the TPU."""
    model = tiny(tied_embeddings=False)
    program = sharded(model, fsdp=fsdp, tensor=tensor)
    chunks = sum(p.device_elements for p in program.param_layout()
                 if p.key not in ("embed/embedding", "unembed/kernel"))
    tables = 2 * math.ceil(V * C / (fsdp * tensor))
    memory = program.memory(2)
    assert memory.parameters_bytes == 4 * (chunks + tables)
    assert memory.optimizer_state_bytes == 2 * memory.parameters_bytes
    assert memory.peak == "backward" and memory.gradients_bytes == memory.parameters_bytes
    assert memory.total_bytes == sum(v for k, v in memory.items().items() if k != "total")


def test_kept_activations_by_remat_in_closed_form():
    """Per example and block (bf16): full keeps the block input (T C); minimal also q, k, v
    (T (H + 2 K) Dh), the summed attention output (T C, read by the second norm) and the
    gated MLP's two input products (2 T F); plus the int32 ids and the output layer's
    inputs (the final norm's input, its 1 / sigma, its output). Offloaded tensors are
    the host's, not HBM's."""
    rest = 4 * T + 2 * T * C * 2 + 4 * T
    full = sharded(tiny(remat="full")).memory(3)
    assert full.activations_bytes == 3 * (2 * T * C * 2 + rest)
    minimal = sharded(tiny(remat="minimal")).memory(3)
    per_block = (T * C + T * (H + 2 * KV) * DH + T * C + 2 * T * F) * 2
    assert minimal.activations_bytes == 3 * (2 * per_block + rest)
    custom = sharded(tiny(remat="custom", remat_custom={"query_proj": "offload",
                                                         "mlpwi_0": "offload"})).memory(3)
    assert custom.host_activations_bytes == 3 * 2 * (T * H * DH + T * F) * 2
    assert custom.activations_bytes == full.activations_bytes
    assert custom.total_bytes < minimal.total_bytes


def test_fsdp_gathers_a_weight_array_and_prefetches_the_next_in_bf16():
    """With fsdp each weight array is gathered whole (over fsdp, its tensor slice) in
    bf16 just before its matmul, the next while it runs: the largest array of a block
    (the gated MLP's C x F / tensor, four chunks with padding) in use and
    ``prefetch_layers`` more; without fsdp nothing is gathered and nothing prefetched."""
    model = tiny()
    program = sharded(model, fsdp=4, tensor=2)
    array = 2 * 4 * math.ceil(C * F // 2 / 4)
    ahead, none = program.memory(2), program.memory(2, prefetch_layers=0)
    assert ahead.prefetch_layers == 1 and none.prefetch_layers == 0
    assert ahead.prefetch_layer_bytes == none.prefetch_layer_bytes == array
    assert dict(ahead.workspace)["gathered weights"] == 2 * array
    assert dict(none.workspace)["gathered weights"] == array
    assert ahead.total_bytes - none.total_bytes == array
    alone = sharded(model).memory(2)
    assert alone.prefetch_layers == alone.prefetch_layer_bytes == 0
    assert "gathered weights" not in dict(alone.workspace)


@pytest.mark.parametrize("block", ["parallel", "sequential"])
@pytest.mark.parametrize("tensor, fused, projections, attention", [
    (1, False, 0, "flash"), (2, False, 3, "flash"), (2, True, 1, "flash"),
    (16, False, 0, "flash"), (2, False, 3, "dot_product")])
def test_the_backward_working_set_in_closed_form(tensor, fused, projections, attention, block):
    """Per example (bf16): the residual's and the block input's gradients (2 T C), and
    the MLP's part, the gated MLP's two input products with its activation's gradient
    (3 T F / tensor) and below 16 tensor devices its two input projections' partial sums
    over tensor (a T C each), beside the attention's, with dot-product attention the
    scores, their softmax and the gradients (DOT_PRODUCT_LIVE_SCORES H T T / tensor, read
    from the oracle's T9 HLO) and below 16 tensor devices the q, k, v (or fused qkv)
    projections' partial sums. A parallel block holds both parts' partial sums at once
    (the larger of products and scores on top); a sequential block one part at a time."""
    heads, kv, f = 16, 16, 64
    model = build_model("transformer", (T,), V, embed_dim=C, heads=heads, kv_heads=kv,
                        head_dim=DH, mlp_dim=f, layers=2, fused_qkv=fused, attention=attention,
                        block=block)
    program = sharded(model, tensor=tensor)
    layer = program.local_model.layers[1]
    scores = (DOT_PRODUCT_LIVE_SCORES * heads // tensor * T * T if attention == "dot_product"
              else 0)
    mlp_partials = 2 if projections else 0
    products = 3 * T * f // tensor
    if block == "parallel":
        expected = 2 * (max(products, scores) + (2 + projections + mlp_partials) * T * C)
    else:
        expected = 2 * (max(products + mlp_partials * T * C, scores + projections * T * C)
                        + 2 * T * C)
    assert backward_working_bytes(layer, (T, C), 2, tensor) == expected
    assert dict(program.memory(3).workspace)["layer working set"] == 3 * expected
    if attention == "dot_product":
        assert scores > 3 * T * f // tensor                            # T x T dominates here


def test_the_copy_of_the_weights_follows_the_precision():
    """float32 masters under bf16 compute: XLA keeps a bf16 copy of the device's weights
    (2 bytes a parameter); fp32 training reads the masters and gathers float32."""
    model = tiny()
    bf16, fp32 = (sharded(model, fsdp=2).memory(1, p) for p in ("bf16", "fp32"))
    assert dict(bf16.workspace)["weights in compute dtype"] == bf16.parameters_bytes // 2
    assert "weights in compute dtype" not in dict(fp32.workspace)
    assert fp32.prefetch_layer_bytes == 2 * bf16.prefetch_layer_bytes
    with pytest.raises(ValueError, match="precision must be one of"):
        sharded(model).memory(1, "fp8")


def test_the_logits_live_into_backward_under_offload_and_vocab_tiling_chunks_them():
    """The logits (bf16, b T V / tensor: MaxText splits the vocabulary over tensor) become
    their gradient in place; under a remat policy that offloads, XLA forms the output
    kernel's gradient after the layers' backward, so they live through it, and
    num_vocab_tiling n holds 1 / n of them at once; with nothing offloaded XLA forms that
    gradient first and holds it, V x C whole, in their place
    (``pod.programs.memory.output_gradient_held``)."""
    big = 50_000
    offload = {"tied_embeddings": False, "remat": "qkv_proj_offloaded"}
    memory = sharded(tiny(big, **offload), fsdp=2, tensor=2).memory(4)
    assert memory.peak == "backward" and memory.host_activations_bytes > 0
    assert dict(memory.workspace)["logits gradient"] == 4 * T * (big // 2) * 2
    tiled = sharded(tiny(big, num_vocab_tiling=4, **offload), fsdp=2, tensor=2).memory(4)
    assert dict(tiled.workspace)["logits gradient"] == 4 * T * (big // 2) * 2 // 4
    assert tiled.total_bytes < memory.total_bytes
    kept = sharded(tiny(big, tied_embeddings=False, remat="full"), fsdp=2, tensor=2).memory(1)
    assert kept.peak == "backward"
    assert kept.host_activations_bytes == 0 and "logits gradient" not in dict(kept.workspace)
    assert dict(kept.workspace)["output kernel gradient"] == big * C * 2
    with pytest.raises(ValueError, match="num_vocab_tiling must be a positive integer"):
        tiny(num_vocab_tiling=0)


def test_the_replicated_program_holds_the_whole_model():
    """Any model on {data: N}: float32 parameters, gradients and state of all of it, its
    activations in bf16, the MXU's bf16 copies of two of its largest layer."""
    mlp = build_model("mlp", (64,), 10, hidden=[64])
    program = ReplicatedProgram(mlp, {"data": 8}, build_optimizer("adam"))
    memory = program.memory(16)
    p = mlp.num_params
    assert (memory.parameters_bytes, memory.gradients_bytes, memory.optimizer_state_bytes) == (
        4 * p, 4 * p, 8 * p)
    assert memory.activations_bytes == mlp.activation_bytes(16) // 2
    assert memory.workspace == (("MXU weight copies", 2 * (64 * 64 + 64) * 2),)
    assert program.memory(16, "fp32").workspace == ()


def test_a_pipeline_stage_holds_its_layers_and_the_microbatches_in_flight():
    """Two stages of four blocks, four microbatches of one example: a stage's chunk keeps
    its blocks' bytes per microbatch in flight, GPipe all four, 1F1B min(S - s, M); the
    stage's parameters are half the blocks'; with pipeline_fsdp_ag_once the stage's four
    blocks are gathered whole for the step instead of two weight arrays at a time."""
    model = tiny(layers=8, remat="full")
    opt = build_optimizer("adamw")
    sizes = {"stage": 2, "fsdp": 2}
    gpipe = PipelinedTransformer(model, sizes, opt, microbatches=4)
    one_f = PipelinedTransformer(model, sizes, opt, microbatches=4, schedule="1f1b")
    once = PipelinedTransformer(model, sizes, opt, microbatches=4, fsdp_ag_once=True)
    a, b, c = (p.memory(4) for p in (gpipe, one_f, once))
    kept_chunk = 4 * T * C * 2                           # full: its four blocks' inputs
    last = kept_chunk + model.output_kept_bytes(2)
    assert a.activations_bytes == 4 * max(kept_chunk, last) == 4 * last
    assert b.activations_bytes == max(2 * kept_chunk, 1 * last)
    flat = sharded(model, fsdp=2).memory(4)
    assert a.parameters_bytes < flat.parameters_bytes
    assert dict(c.workspace)["gathered weights"] > dict(a.workspace)["gathered weights"]
    assert isinstance(a, DeviceMemory) and a.peak.startswith("stage ")


def test_an_moe_blocks_backward_holds_its_expert_products_and_their_gradients():
    """A gated MoE's part is 2 m + 1 = 5 arrays of its dispatch slots x F (the recomputed
    products, the activation's output and gradient, the products' gradients), a dense
    gated MLP's m + 1 = 3 of T x F: the slots from the capacity, T k / E x 1.25 per
    expert (``MoE.dot_elements``)."""
    experts, k, f = 4, 2, 64
    moe = build_model("transformer", (T,), V, embed_dim=C, heads=4, kv_heads=4, head_dim=DH,
                      mlp_dim=f, layers=2, experts=experts, experts_per_token=k,
                      capacity_factor=1.25)
    dense = build_model("transformer", (T,), V, embed_dim=C, heads=4, kv_heads=4, head_dim=DH,
                        mlp_dim=f, layers=2)
    moe_block, dense_block = (sharded(m).local_model.layers[1] for m in (moe, dense))
    slots = experts * math.ceil(T * k / experts * 1.25)
    assert moe_block.mlp.dot_elements((T, C)) == 2 * slots * f
    residual = 2 * T * C
    assert backward_working_bytes(moe_block, (T, C), 2, 1) == 2 * (5 * slots * f + residual)
    assert backward_working_bytes(dense_block, (T, C), 2, 1) == 2 * (3 * T * f + residual)


@pytest.mark.parametrize("remat, held", [
    ("full", T * (2 * H * DH + 2 * KV * DH)),        # q, k, v and the kernel's output
    ("minimal", T * H * DH),                          # q, k, v kept: the output alone
    ("save_qkv_proj", T * H * DH),
    ("none", 0)])                                     # everything kept (activations)
def test_a_sequential_block_holds_its_recomputed_attention_through_the_mlps_backward(
        remat, held):
    """The attention's tensors the policy does not keep are recomputed with the block's
    forward and live until the attention's backward, which in a sequential block runs
    after the MLP's (read from gpt-style-v5p-64's and llama2-7b-full-b4's scheduled HLO):
    q (T H Dh), k and v (T K Dh each), the kernel's output (T H Dh). A parallel block's
    two backward passes are unordered: nothing added there."""
    layers = {}
    for block in ("sequential", "parallel"):
        layer = sharded(tiny(block=block, remat=remat)).local_model.layers[1]
        layers[block] = backward_working_bytes(layer, (T, C), 2, 1)
        assert recomputed_attention_elements(layer, T) == held
    assert layers["sequential"] - 2 * held == 2 * (3 * T * F + 2 * T * C)
    assert layers["parallel"] == 2 * (3 * T * F + 2 * T * C)


def test_a_dense_dropless_moe_holds_four_expert_products_in_its_backward():
    """Dense dropless (every expert on every token, MaxText's ``dense_matmul``): 2 m = 4
    arrays of T x E x F at the backward's peak, the recomputed products and the output
    einsum's two results (T8-dropless's and mixtral-v5p-128-dropless's scheduled HLO),
    where a capacity's dispatch holds 2 m + 1."""
    experts, k, f = 4, 2, 64
    moe = build_model("transformer", (T,), V, embed_dim=C, heads=4, kv_heads=4, head_dim=DH,
                      mlp_dim=f, layers=2, experts=experts, experts_per_token=k,
                      capacity_factor=0, sparse_matmul=False)
    block = sharded(moe).local_model.layers[1]
    assert block.mlp.dense_dropless
    product = T * experts * f                        # one product: every token, every expert
    assert backward_working_bytes(block, (T, C), 2, 1) == 2 * (4 * product + 2 * T * C)


def test_programs_of_one_model_share_their_chunk_counts_and_keep_their_figures():
    """The programs of one tensor-local model on one (fsdp, tensor) share their chunk sizes
    and sums (``transformer._Counts``; tpu-pod plan builds thousands of programs of a few
    models); each program's chunks are still ceil(elements / fsdp) of its own layout, its
    memory that of the same program built with nothing shared, in any order of meshes."""
    import pod.programs.transformer as transformer

    def figures(program):
        shard = program.shape_shard()
        sizes = {k: v.size for k, v in shard.params.items()}
        return sizes, program.memory(2), program.memory(1, prefetch_layers=0)

    model = tiny(tied_embeddings=False, layers=4)
    order = [{"fsdp": 2, "tensor": 2}, {"fsdp": 4, "tensor": 2}, {"fsdp": 2, "tensor": 2},
             {"fsdp": 2, "tensor": 2, "stage": 2}, {"fsdp": 4, "tensor": 1}]
    warm = []
    for sizes in order:
        program = (PipelinedTransformer(model, sizes, build_optimizer("adamw"), microbatches=2)
                   if "stage" in sizes else sharded(model, **sizes))
        layout = {p.key: p.device_elements for p in program.param_layout()}
        sizes_now = figures(program)[0]
        assert all(sizes_now[k] == layout[k] for k in sizes_now)  # -(-elements // fsdp)
        warm.append((program, figures(program)))
    assert warm[0][0]._counts is warm[2][0]._counts is warm[3][0]._counts
    assert warm[0][0]._counts is not warm[1][0]._counts
    for (program, got), sizes in zip(warm, order, strict=True):
        transformer._LAYOUTS.clear()  # a cold program: nothing shared
        cold = (PipelinedTransformer(tiny(tied_embeddings=False, layers=4), sizes,
                                     build_optimizer("adamw"), microbatches=2)
                if "stage" in sizes else sharded(tiny(tied_embeddings=False, layers=4), **sizes))
        assert cold._counts is not program._counts and figures(cold) == got
