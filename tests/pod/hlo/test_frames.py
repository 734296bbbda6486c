"""Where an op sits in the user's program (``pod.hlo.frames``, ``HloModule.source_of`` /
``call_chain_of``): the chain of a committed module's op against its own tables walked by
hand, the user's code preferred over the frameworks', and "" without tables."""

from __future__ import annotations

import re

import pytest

from pod.hlo import parse_hlo
from pod.hlo.frames import is_library_file
from tests.pod.hlo.conftest import snippet_text

#: A step of a user's own (train.py, model.py) calling into flax and optax (site-packages),
#: started from ``python -m`` (Python's runpy). Printed ``parent_frame_id`` = parent + 1.
USER_AND_LIBRARY = """HloModule jit_train_step, is_scheduled=true

FileNames
1 "/home/u/proj/train.py"
2 "/home/u/proj/model.py"
3 "/home/u/.venv/lib/python3.12/site-packages/flax/linen/linear.py"
4 "/home/u/.venv/lib/python3.12/site-packages/optax/_src/transform.py"
5 "<frozen runpy>"

FunctionNames
1 "_run_module_as_main"
2 "main"
3 "train_step"
4 "loss_fn"
5 "Decoder.__call__"
6 "Dense.__call__"
7 "scale_by_adam.<locals>.update_fn"

FileLocations
1 {file_name_id=5 function_name_id=1 line=198 end_line=198 column=1 end_column=1}
2 {file_name_id=1 function_name_id=2 line=40 end_line=40 column=1 end_column=1}
3 {file_name_id=1 function_name_id=3 line=30 end_line=30 column=1 end_column=1}
4 {file_name_id=1 function_name_id=4 line=20 end_line=20 column=1 end_column=1}
5 {file_name_id=2 function_name_id=5 line=12 end_line=12 column=1 end_column=1}
6 {file_name_id=3 function_name_id=6 line=250 end_line=250 column=1 end_column=1}
7 {file_name_id=4 function_name_id=7 line=380 end_line=380 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}
5 {file_location_id=5 parent_frame_id=5}
6 {file_location_id=6 parent_frame_id=6}
7 {file_location_id=7 parent_frame_id=4}
8 {file_location_id=6 parent_frame_id=1}

ENTRY %main (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  %dense = f32[8]{0} negate(%p), metadata={op_name="jit(train_step)/dot_general" stack_frame_id=6}
  %adam = f32[8]{0} negate(%dense), metadata={op_name="jit(train_step)/mul" stack_frame_id=7}
  %lib = f32[8]{0} negate(%adam), metadata={op_name="jit(train_step)/neg" stack_frame_id=8}
  ROOT %none = f32[8]{0} negate(%lib), metadata={op_name="jit(train_step)/neg"}
}
"""


def _by_hand(text: str, frame: str) -> list[tuple[str, str, str]]:
    """(location id, file, function) of ``frame`` and each caller, innermost first, read
    straight off the text's tables: a frame's parent is its printed parent_frame_id - 1."""
    tables: dict[str, dict[str, str]] = {}
    table = ""
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
        elif table and re.match(r"\d+ ", line):
            key, value = line.split(" ", 1)
            tables.setdefault(table, {})[key] = value
        elif line.strip():
            table = ""
    out = []
    while frame in tables["StackFrames"]:
        location, parent = re.findall(r"=(\d+)", tables["StackFrames"][frame])
        file_id, function_id = re.findall(r"_id=(\d+)", tables["FileLocations"][location])
        out.append((location, tables["FileNames"][file_id].strip('"'),
                    tables["FunctionNames"][function_id].strip('"')))
        frame = str(int(parent) - 1)
    return out


def test_a_committed_ops_chain_is_its_tables_walked_by_hand():
    text = snippet_text("fsdp_block", "tpu")
    module = parse_hlo(text)
    # the step's first einsum (tools/hlo_snippets.py: fsdp_step's loss scans block, whose
    # first line is q = einsum("btd,dhk->bthk", x, wq))
    conv = next(i for _, i in module.instructions() if i.opcode == "convolution"
                and i.op_name.endswith("jvp()/while/body/closed_call/btd,dhk->bthk/dot_general"))
    walked = _by_hand(text, conv.metadata["stack_frame_id"])
    # jax repeated the enclosing frames once per nested level (the scan, the gradient)
    assert [f for _, _, f in walked].count("_steps.<locals>.fsdp_step.<locals>.loss") == 3
    once = [w for k, w in enumerate(walked) if w[0] not in {v[0] for v in walked[:k]}]
    assert [(f.location, f.file, f.function) for f in module.stack_of(conv)] == once
    names = [f for _, _, f in reversed(once)]
    assert names[:3] == ["<module>", "main", "_compile"]       # outside jax.jit
    assert module.call_chain_of(conv) == " > ".join(names[3:]) == (
        "_steps.<locals>.fsdp_step > _steps.<locals>.fsdp_step.<locals>.loss > "
        "_steps.<locals>.block")
    assert module.source_of(conv).startswith("hlo_snippets.py:")
    assert module.source_of(conv).endswith(" (_steps.<locals>.block)")


def test_the_users_frame_is_preferred_over_the_frameworks():
    module = parse_hlo(USER_AND_LIBRARY)
    ops = module.entry_computation.by_name
    # flax's Dense inside the user's Decoder: the user's line, the whole chain
    assert module.source_of(ops["dense"]) == "model.py:12 (Decoder.__call__)"
    assert module.call_chain_of(ops["dense"]) == (
        "train_step > loss_fn > Decoder.__call__ > Dense.__call__")
    # optax's update called from the user's step
    assert module.source_of(ops["adam"]) == "train.py:30 (train_step)"
    assert module.call_chain_of(ops["adam"]) == "train_step > scale_by_adam.<locals>.update_fn"
    # library frames only: the innermost; no frame of the jitted function: every frame
    assert module.source_of(ops["lib"]) == "linear.py:250 (Dense.__call__)"
    assert module.call_chain_of(ops["lib"]) == "Dense.__call__"
    assert module.source_of(ops["none"]) == module.call_chain_of(ops["none"]) == ""


def test_a_module_jax_did_not_name_keeps_the_frames_outside_the_step():
    module = parse_hlo(USER_AND_LIBRARY.replace("HloModule jit_train_step", "HloModule m"))
    assert module.call_chain_of(module.entry_computation.by_name["adam"]) == (
        "_run_module_as_main > main > train_step > scale_by_adam.<locals>.update_fn")


@pytest.mark.parametrize("name", ["matmul", "mlp_scan"])
def test_a_module_without_tables_has_no_chain(name):
    text = snippet_text(name, "cpu")
    module = parse_hlo(text[:text.index("FileNames")] + text[text.index("\n%"):])
    assert not module.frames
    for _, instr in module.instructions():
        assert module.call_chain_of(instr) == "" and module.stack_of(instr) == ()
    # the source_file / source_line metadata of older XLA still names the line
    small = parse_hlo("HloModule m\nENTRY %e (p: f32[2]) -> f32[2] {\n  %p = f32[2] parameter(0)\n"
                      '  ROOT %y = f32[2] negate(%p), metadata={op_name="jit(f)/neg" '
                      'source_file="/a/b/f.py" source_line=7}\n}\n')
    y = small.entry_computation.by_name["y"]
    assert small.source_of(y) == "f.py:7" and small.call_chain_of(y) == ""


@pytest.mark.parametrize("path, library", [
    ("/x/.venv/lib/python3.12/site-packages/jax/_src/numpy/lax_numpy.py", True),
    ("/x/.venv/lib/python3.12/site-packages/optax/_src/transform.py", True),
    ("/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py", True),
    ("flax/nnx/training/optimizer.py", True),        # a portable dump's path
    ("<frozen runpy>", True),
    ("/usr/lib/python3.12/functools.py", True),        # the standard library
    ("/src/jax/jax/_src/lax/lax.py", True),            # a source checkout of jax
    ("maxtext/layers/linears.py", False),              # a model library: the user's
    ("/x/.venv/lib/python3.12/site-packages/maxtext/layers/attentions.py", False),
    ("/home/u/proj/my_model.py", False),
    ("my_model.py", False),
    ("/home/u/jaxnotes/train.py", False),
])
def test_library_files_by_path(path, library):
    assert is_library_file(path) is library
