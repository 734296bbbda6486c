"""The liveness walk of ``pod.hlo.memory`` on hand-written scheduled modules whose peak is
counted by hand: a chain, a while loop and its body, tuples and aliases (in-place updates,
partial ``output_to_operand_aliasing``, async pairs, donated outputs), layout tiles and
memory spaces."""

from __future__ import annotations

import pytest

from pod.hlo.memory import memory_peak, peak_bytes
from pod.hlo.module import parse_hlo

K = 256 * 128 * 4          # one f32[256,128]
A = "f32[256,128]{1,0}"


def _module(entry: str, *computations: str, header: str = "") -> str:
    return "\n".join([f"HloModule m, is_scheduled=true{header}", *computations,
                      "ENTRY %main () -> f32[] {", entry, "}", ""])


def test_a_chain_holds_each_value_until_its_last_reader():
    # a -> b -> c -> d, and d also reads a: a lives throughout (argument), each
    # intermediate until its reader; at c: a, b (read by c), c = 3 K; at d: a, c, d = 3 K
    # (b dead). With e = b + d, b lives to the end: at d, a, b, c, d = 4 K.
    chain = f"""  %a = {A} parameter(0)
  %b = {A} exponential(%a)
  %c = {A} negate(%b)
  ROOT %d = {A} add(%c, %a)"""
    text = _module(chain).replace("() -> f32[]", f"(a: {A}) -> {A}")
    peak = memory_peak(parse_hlo(text))
    assert peak.peak_bytes == 3 * K and peak.at == "c" and peak.inner is None
    assert [b.name for b in peak.live] == ["a", "b", "c"]
    longer = chain.replace("ROOT %d", "%d") + f"\n  ROOT %e = {A} add(%b, %d)"
    text = _module(longer).replace("() -> f32[]", f"(a: {A}) -> {A}")
    peak = memory_peak(parse_hlo(text))
    assert peak.peak_bytes == 4 * K and peak.at == "d"
    assert {b.name: b.size_bytes for b in peak.live} == {"a": K, "b": K, "c": K, "d": K}


BODY = f"""%body (bp: (s32[], {A})) -> (s32[], {A}) {{
  %bp = (s32[], {A}) parameter(0)
  %i = s32[] get-tuple-element(%bp), index=0
  %x = {A} get-tuple-element(%bp), index=1
  %t = {A} exponential(%x), metadata={{op_name="jit(f)/while/body/exp"}}
  %t2 = {A} exponential(%t)
  %y = {A} add(%t, %t2)
  ROOT %r = (s32[], {A}) tuple(%i, %y)
}}
%cond (cp: (s32[], {A})) -> pred[] {{
  %cp = (s32[], {A}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}}"""


def test_a_while_adds_its_bodys_own_peak_and_counts_its_state_once():
    # outside: a (argument), the carried state c (K) and the scalar counter z (4 bytes,
    # a constant: no heap buffer). The body's own: t and t2 at t2 (2 K); x is the carried
    # state, y the new state written into the carry's buffer. Peak at the loop: a + c + 2 K.
    entry = f"""  %a = {A} parameter(0)
  %z = s32[] constant(0)
  %c = {A} negate(%a)
  %tup = (s32[], {A}) tuple(%z, %c)
  %w = (s32[], {A}) while(%tup), condition=%cond, body=%body
  ROOT %out = {A} get-tuple-element(%w), index=1"""
    text = _module(entry, BODY).replace("() -> f32[]", f"(a: {A}) -> {A}")
    peak = memory_peak(parse_hlo(text))
    assert peak.at == "w" and peak.peak_bytes == 4 * K
    assert [b.name for b in peak.live] == ["a", "c"]
    assert peak.inner is not None and peak.inner.computation == "body"
    assert peak.inner.at == "t2" and peak.inner.peak_bytes == 2 * K
    assert [b.name for b in peak.inner.live] == ["t", "t2"]


def test_in_place_updates_and_aliases_define_no_buffer():
    # b (2 K) updated in place by the fusion d (a dynamic-update-slice of its parameter 0)
    # and by the dynamic-update-slice f: one buffer; the bitcast and the tuple pass theirs
    # on. The peak, 4 K, is first reached at c: a, b, c (read by d); were d or f a new
    # buffer, 6 K at either.
    dus = """%dus_comp (p0: f32[512,128], p1: f32[256,128]) -> f32[512,128] {
  %p0 = f32[512,128]{1,0} parameter(0)
  %p1 = f32[256,128]{1,0} parameter(1)
  %z = s32[] constant(0)
  ROOT %u = f32[512,128]{1,0} dynamic-update-slice(%p0, %p1, %z, %z)
}"""
    entry = f"""  %a = {A} parameter(0)
  %zero = s32[] constant(0)
  %b = f32[512,128]{{1,0}} broadcast(%a), dimensions={{1}}
  %c = {A} slice(%b), slice={{[0:256], [0:128]}}
  %d = f32[512,128]{{1,0}} fusion(%b, %c), kind=kLoop, calls=%dus_comp
  %e = {A} slice(%d), slice={{[256:512], [0:128]}}
  %f = f32[512,128]{{1,0}} dynamic-update-slice(%d, %e, %zero, %zero)
  %g = f32[128,512]{{0,1}} bitcast(%f)
  ROOT %t = (f32[128,512]{{0,1}}, {A}) tuple(%g, %e)"""
    text = _module(entry, dus).replace("() -> f32[]", f"(a: {A}) -> (f32[128,512], {A})")
    peak = memory_peak(parse_hlo(text))
    assert peak.peak_bytes == 4 * K and peak.at == "c"
    assert [b.name for b in peak.live] == ["b", "a", "c"]


def test_a_fusion_aliases_only_the_outputs_it_declares():
    # XLA's async collective fusion: output {0} is its operand's buffer (the shard), {1}
    # the gathered array (4 K), new; the done passes {1} on (aliasing its operand 1).
    # At the start: a (K) and the gathered 4 K.
    g = "f32[1024,128]{1,0}"
    comps = f"""%start_comp (p: {A}) -> ({A}, {g}) {{
  %p = {A} parameter(0)
  %ag = {g} all-gather(%p), dimensions={{0}}, replica_groups={{{{0,1,2,3}}}}
  ROOT %r = ({A}, {g}) tuple(%p, %ag)
}}
%done_comp (q: {A}, h: {g}) -> {g} {{
  %q = {A} parameter(0)
  ROOT %h = {g} parameter(1)
}}"""
    entry = f"""  %a = {A} parameter(0)
  %s = ({A}, {g}) fusion(%a), kind=kCustom, output_to_operand_aliasing={{{{0}}: (0, {{}})}}, calls=%start_comp
  %s0 = {A} get-tuple-element(%s), index=0
  %s1 = {g} get-tuple-element(%s), index=1
  %d = {g} fusion(%s0, %s1), kind=kCustom, output_to_operand_aliasing={{{{}}: (1, {{}})}}, calls=%done_comp
  ROOT %n = {g} negate(%d)"""
    text = _module(entry, comps).replace("() -> f32[]", f"(a: {A}) -> {g}")
    peak = memory_peak(parse_hlo(text))
    assert peak.peak_bytes == K + 4 * K + 4 * K and peak.at == "n"
    assert [b.name for b in peak.live] == ["n", "s{1}", "a"]


def test_async_pairs_hold_their_operands_and_define_their_results():
    # copy-start (destination, source, context): the destination is new (K), the context
    # in S(2) is no HBM; collective-permute-start (operand, result, ...): the result is
    # new. Both dones pass theirs on. At r: a, the copy's destination, the permute's
    # result and r = 4 K (the copy's source is a itself).
    entry = f"""  %a = {A} parameter(0)
  %cs = ({A}, {A}, u32[]{{:S(2)}}) copy-start(%a)
  %ps = ({A}, {A}, u32[]{{:S(2)}}, u32[]{{:S(2)}}) collective-permute-start(%a), source_target_pairs={{{{0,1}},{{1,0}}}}
  %cd = {A} copy-done(%cs)
  %pd = {A} collective-permute-done(%ps)
  ROOT %r = {A} add(%cd, %pd)"""
    text = _module(entry).replace("() -> f32[]", f"(a: {A}) -> {A}")
    peak = memory_peak(parse_hlo(text))
    assert peak.peak_bytes == 4 * K
    assert sorted(b.name for b in peak.live) == ["a", "cs{0}", "ps{1}", "r"]


def test_outputs_written_into_donated_arguments_are_no_new_buffer():
    # the optimizer's new weights n take the donated w's buffer; m is new.
    entry = f"""  %w = {A} parameter(0)
  %g = {A} parameter(1)
  %n = {A} subtract(%w, %g)
  %m = {A} multiply(%g, %g)
  ROOT %t = ({A}, {A}) tuple(%n, %m)"""
    text = _module(entry).replace("() -> f32[]", f"(w: {A}, g: {A}) -> ({A}, {A})")
    donated = text.replace("is_scheduled=true", "is_scheduled=true, input_output_alias={ {0}: "
                           "(0, {}, may-alias) }")
    assert peak_bytes(parse_hlo(text)) == 4 * K
    assert peak_bytes(parse_hlo(donated)) == 3 * K


@pytest.mark.parametrize("layout, tiled, untiled", [
    ("{1,0:T(8,128)(2,1)}", 8 * 128 * 2, 4 * 100 * 2),     # rows to 8, columns to 128
    ("{0,1:T(8,128)(2,1)}", 104 * 128 * 2, 4 * 100 * 2),   # layout order: 100 rows of 4
    ("{1,0}", 4 * 100 * 2, 4 * 100 * 2),                   # no tile
    ("{1,0:T(8,128)(2,1)S(1)}", 0, 0),                     # VMEM
    ("{1,0:T(8,128)(2,1)S(3)}", 0, 0),                     # v4's CMEM
    ("{1,0:S(5)}", 0, 0),                                  # host memory
])
def test_tiles_pad_the_minor_dimensions_and_other_memory_spaces_are_no_hbm(
        layout, tiled, untiled):
    text = f"""HloModule m, is_scheduled=true
ENTRY %main (a: bf16[4,100]) -> bf16[4,100] {{
  ROOT %a = bf16[4,100]{layout} parameter(0)
}}
"""
    module = parse_hlo(text)
    assert peak_bytes(module, tiled=True) == tiled
    assert peak_bytes(module) == untiled
