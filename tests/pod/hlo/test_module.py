"""Parsing HLO text (``pod.hlo.module``): XLA's TPU- and CPU-compiled modules as committed,
shapes and their bytes, attributes, and one line naming the line for text that does not
parse."""

from __future__ import annotations

import pytest

from pod.errors import HloParseError
from pod.hlo import is_tpu_compiled, parse_hlo
from pod.hlo.module import parse_shape, split_top
from tests.pod.hlo.conftest import SNIPPETS, snippet_text

SMALL = """HloModule small, is_scheduled=true, num_partitions=2

%body (p: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %p = (s32[], bf16[8,128]{1,0:T(8,128)(2,1)}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %x = bf16[8,128]{1,0:T(8,128)(2,1)S(1)} get-tuple-element(%p), index=1
  %y = bf16[8,128]{1,0} negate(%x), metadata={op_name="jit(f)/neg" source_file="/a/b/f.py" source_line=7}, backend_config={"window_config":{"estimated_cycles":"120"}}
  ROOT %t = (s32[], /*index=1*/bf16[8,128]) tuple(%next, %y)
}

%cond (p: (s32[], bf16[8,128])) -> pred[] {
  %p = (s32[], bf16[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[8,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,128]) tuple(%zero, %a)
  %w = (s32[], bf16[8,128]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = bf16[8,128]{1,0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
@pytest.mark.parametrize("name", SNIPPETS)
def test_committed_modules_parse(modules, name, platform):
    module = modules[(name, platform)]
    assert module.entry_computation.is_entry
    assert module.is_scheduled
    assert module.devices == (1 if name == "matmul" else 8)
    assert is_tpu_compiled(module) == (platform == "tpu")
    for comp, instr in module.instructions():  # every operand names an instruction of comp
        assert all(o in comp.by_name for o in instr.operands), (comp.name, instr.name)


def test_a_small_module_as_written():
    module = parse_hlo(SMALL)
    assert module.entry == "main" and module.num_partitions == 2
    body = module.computations["body"]
    y = body.by_name["y"]
    assert y.opcode == "negate" and y.operands == ("x",)
    assert y.op_name == "jit(f)/neg" and module.source_of(y) == "f.py:7"
    assert y.estimated_cycles == 120
    assert body.by_name["x"].shape.array.memory_space == 1            # S(1): VMEM
    assert body.by_name["x"].shape.hbm_bytes() == 0
    assert body.root.shape.is_tuple and len(body.root.shape.leaves) == 2
    assert module.entry_computation.by_name["w"].known_trip_count == 5
    assert module.entry_computation.by_name["w"].called == ("cond", "body")
    assert body.by_name["one"].literal == "1"


@pytest.mark.parametrize("text, nbytes", [
    ("bf16[8,128]{1,0:T(8,128)(2,1)}", 8 * 128 * 2), ("f32[]", 4), ("pred[3,5]", 15),
    ("s4[7]", 4), ("(s32[], bf16[2,2]{1,0}, (f32[4]))", 4 + 8 + 16), ("token[]", 0)])
def test_shape_bytes(text, nbytes):
    assert parse_shape(text).nbytes == nbytes


def test_split_top_keeps_nested_commas():
    assert split_top('a={1,2}, b="x,y", c=f(1,2), d=[3,4]') == [
        "a={1,2}", 'b="x,y"', "c=f(1,2)", "d=[3,4]"]


def test_stack_frames_name_the_users_function(modules):
    module = modules[("fsdp_block", "tpu")]
    sources = {module.source_of(i) for _, i in module.instructions()}
    assert any("hlo_snippets.py:" in s and "block" in s for s in sources)


def _broken(old: str, new: str) -> str:
    assert old in SMALL
    return SMALL.replace(old, new)


@pytest.mark.parametrize("text, line, words", [
    (_broken("  %one = s32[] constant(1)", "  %one = s32[] constant(1"), 6, "unbalanced"),
    (_broken("  %next = s32[] add(%i, %one)", "  %next = s32[ add(%i, %one)"), 7, "shape"),
    (_broken("  %next = s32[] add(%i, %one)", "  %next = s32[] add(%i, 3 + 4)"), 7, "operand"),
    (_broken("condition=%cond", "condition=%nowhere"), 24, "nowhere"),
    (_broken("ENTRY %main", "%main"), 0, "ENTRY"),
    (SMALL.rstrip().removesuffix("}"), 20, "not closed"),
    ("garbage here\n", 1, "computation header"),
])
def test_text_that_does_not_parse_names_its_line(text, line, words):
    with pytest.raises(HloParseError) as err:
        parse_hlo(text)
    assert err.value.line == line and words in str(err.value)
    if line:
        assert str(err.value).startswith(f"line {line}: ")
    assert "\n" not in str(err.value)


def test_cpu_and_tpu_texts_differ_as_the_pitfalls_say():
    """The CPU module of the same step has plain dots; the TPU one, convolutions in
    fusions (reference/pitfalls.md, "JAX and XLA as an oracle")."""
    cpu, tpu = snippet_text("mlp_scan", "cpu"), snippet_text("mlp_scan", "tpu")
    assert " dot(" in cpu and " convolution(" in tpu and " dot(" not in tpu


def test_an_instruction_printed_over_several_lines_is_one_instruction():
    """XLA prints a Pallas kernel's metadata (splash attention's ``kernel_metadata``) with
    line breaks inside the instruction's braces: the lines are one instruction."""
    text = SMALL.replace("  %one = s32[] constant(1)",
                         '  %one = s32[] constant(1), frontend_attributes={kernel_metadata={\n'
                         '"xprof_metadata":"{\\"block_q\\": 512}"\n}}')
    assert text != SMALL
    module, small = parse_hlo(text), parse_hlo(SMALL)
    assert [i.name for _, i in module.instructions()] == [i.name for _, i in small.instructions()]
    assert "xprof_metadata" in next(i for _, i in module.instructions()
                                    if i.name == "one").attrs["frontend_attributes"]
    with pytest.raises(HloParseError, match="braces not closed"):
        parse_hlo(SMALL.replace("  %one = s32[] constant(1)",
                                "  %one = s32[] constant(1), frontend_attributes={x={"))


def test_a_computation_on_another_execution_thread_closes_with_its_name():
    """libtpu 0.0.50 offloads gathers to the SparseCore: their computations close with
    ``}, execution_thread="sparsecore"`` (the oracle's T2 step on jax 0.12); the others
    run on ``main``."""
    text = SMALL.replace("  ROOT %lt = pred[] compare(%i, %n), direction=LT\n}",
                         "  ROOT %lt = pred[] compare(%i, %n), direction=LT\n"
                         '}, execution_thread="sparsecore"')
    assert text != SMALL
    module = parse_hlo(text)
    assert module.computations["cond"].execution_thread == "sparsecore"
    assert module.computations["body"].execution_thread == "main"
    assert [i.name for _, i in module.instructions()] == \
        [i.name for _, i in parse_hlo(SMALL).instructions()]
