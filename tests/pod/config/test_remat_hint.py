"""A model that does not fit its mesh: a remat policy that would is named before "use a
smaller model" (issue 25, item 8), the one that recomputes least."""

from __future__ import annotations

from pathlib import Path

import pytest

import pod
from pod.errors import HBMPlanError

LLAMA = Path(__file__).resolve().parents[3] / "scenarios/llama-33b-v5p-128.yaml"


def _message(*overrides: str) -> str:
    with pytest.raises(HBMPlanError) as caught:
        pod.validate(LLAMA, overrides=list(overrides))
    return str(caught.value)


def test_the_remat_that_fits_comes_before_a_smaller_model():
    text = _message("model.options.remat=none", "training.global_batch=256")
    assert text.startswith("pod.mesh: {fsdp: 16, tensor: 4} needs 401.4 GiB per device")
    hint = text.index("with model.options.remat: full it fits (")
    assert hint < text.index("use a smaller model")
    assert "\n" not in text
    # and it does: the same scenario with that policy plans
    plan = pod.validate(LLAMA, overrides=["model.options.remat=full",
                                          "training.global_batch=256"])
    assert f"({plan.memory['total'] / 2**30:.1f} GiB per device)" in text


def test_the_policy_named_is_the_one_that_recomputes_least():
    """4 sequences per device: minimal (93 of 95 GiB) and full both fit; minimal is named."""
    text = _message("model.options.remat=none")
    assert "with model.options.remat: minimal it fits (92.9 GiB per device)" in text


def test_no_remat_hint_where_no_policy_fits():
    text = _message("pod.slice=v5p-8", "pod.mesh={fsdp: 4}", "training.global_batch=4")
    assert "remat" not in text and "use a smaller model" in text
