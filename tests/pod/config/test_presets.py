"""Model presets (``pod.config.presets``): each preset's parameter count, computed by the
transformer's own ``TransformerConfig.param_count()``, equals its published figure (within the
figure's rounding) and the released checkpoint's exact count where one is published; a
preset expands in a scenario with any option overridden; Mixtral's experts included."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

import pod
from pod.cli import main
from pod.config.presets import (MAXTEXT_2023, PRESETS, expand_model, get_preset, maxtext_2023,
                                parameter_scale, preset_names)
from pod.errors import ScenarioError
from pod.workloads.transformer import TransformerConfig

DENSE = list(PRESETS)  # every preset, Mixtral's experts included


def _count(preset) -> int:
    return TransformerConfig(vocabulary=preset.vocabulary, sequence_length=preset.sequence_length,
                             **preset.options()).param_count()


@pytest.mark.parametrize("name", DENSE)
def test_every_preset_has_its_published_parameter_count(name):
    preset = PRESETS[name]
    assert abs(_count(preset) - preset.published_params) <= preset.published_tolerance, (
        f"{name}: {_count(preset):,} against the published {preset.published_params:,.0f}")
    assert preset.source and "[" in preset.source  # a cited source


#: The released checkpoints' exact counts (the sum of their tensors' sizes), less what the
#: emulator does not model: Gemma 2's norms after attention and after the MLP (2 E per layer).
RELEASED = {
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800, "mistral-7b": 7_241_732_096,
    # [GEMMA2] Table 2: embedding + non-embedding parameters
    "gemma2-9b": 917_504_000 + 8_324_201_984 - 42 * 2 * 3584,
    "gemma2-27b": 1_179_648_000 + 26_047_480_320 - 46 * 2 * 4608,
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_count_is_the_released_checkpoint_s(name):
    assert _count(PRESETS[name]) == RELEASED[name]


def _closed_form(e, h, k, d, f, layers, v, *, gated=True, tied=False, experts=1, active=None):
    """A decoder's parameters: per layer two RMSNorms, q and out (E x H D), k and v (E x K D),
    the MLP (3 E F gated, per expert, with a router E x experts); a final norm; the table;
    an untied output layer."""
    mlp = (3 if gated else 2) * e * f
    per_layer = 2 * e + 2 * e * h * d + 2 * e * k * d + (active or experts) * mlp
    per_layer += e * experts if experts > 1 else 0
    return layers * per_layer + e + v * e * (1 if tied else 2)


def test_gpt3_is_175b_within_half_a_percent_and_its_closed_form():
    """[GPT3] Table 2.1: 175.0B. Per layer 12 E^2 (q k v o and a 4E MLP) + 13 E (biases 9 E,
    two LayerNorms 4 E); learned positions T E; tied embeddings V E."""
    e, layers, v, t = 12288, 96, 50257, 2048
    expected = layers * (12 * e * e + 13 * e) + 2 * e + v * e + t * e
    assert _count(PRESETS["gpt3-175b"]) == expected
    assert abs(expected / 175.0e9 - 1) < 0.005


def test_gemma3_27b_is_the_report_s_text_model():
    """[GEMMA3] Table 1: 25,600M non-embedding and 1,416M embedding parameters (the 417M
    vision encoder apart): the non-embedding part rounds to 25,600M; the total is within 0.5%."""
    preset = PRESETS["gemma3-27b"]
    non_embedding = _count(preset) - preset.vocabulary * preset.embed_dim
    assert round(non_embedding / 1e8) == 256  # 25,600M, to the report's hundred million
    assert abs(_count(preset) / (25_600e6 + 1_416e6) - 1) < 0.005


def test_mixtral_expands_with_its_experts_and_its_published_counts():
    """[MIXTRAL]: 46.7B parameters, 12.9B active per token (2 of 8 experts): the closed form,
    and the transformer's own counts of the expanded preset."""
    preset = PRESETS["mixtral-8x7b"]
    dims = dict(e=preset.embed_dim, h=preset.heads, k=preset.kv_heads, d=preset.head_dim,
                f=preset.mlp_dim, layers=preset.layers, v=preset.vocabulary, experts=8)
    assert round(_closed_form(**dims) / 1e8) / 10 == 46.7
    assert round(_closed_form(**dims, active=2) / 1e8) / 10 == 12.9
    model = expand_model({"preset": "mixtral-8x7b"})
    assert model["options"]["experts"] == 8 and model["options"]["experts_per_token"] == 2
    cfg = TransformerConfig(vocabulary=preset.vocabulary, sequence_length=4096,
                            **model["options"])
    assert cfg.param_count() == _closed_form(**dims)
    assert cfg.param_count(active=True) == _closed_form(**dims, active=2)
    assert "8 experts (top 2)" in preset.dimensions()


def test_the_llama_closed_form_agrees_with_the_model():
    p = PRESETS["llama3.1-70b"]
    assert _count(p) == _closed_form(p.embed_dim, p.heads, p.kv_heads, p.head_dim, p.mlp_dim,
                                     p.layers, p.vocabulary)


@pytest.mark.parametrize("scale, published", [(32, 32.5e9), (16, 16e9)])
def test_the_maxtext_2023_family_by_global_parameter_scale(scale, published):
    """training-steps.md: T1 (s = 32) is 32.5B; MaxText's v5e table calls s = 16 "16B"."""
    preset = maxtext_2023(scale)
    digits = 1 if published == 32.5e9 else 0
    assert round(_count(preset) / 1e9, digits) == published / 1e9
    assert get_preset(f"maxtext-2023-s{scale}") == preset == get_preset("maxtext-2023", scale)
    f = parameter_scale(scale)
    assert (preset.embed_dim, preset.heads, preset.mlp_dim, preset.layers) == (
        MAXTEXT_2023.embed_dim * f.embed, MAXTEXT_2023.heads * f.heads,
        MAXTEXT_2023.mlp_dim * f.mlp, MAXTEXT_2023.layers * f.layers)
    assert (preset.mlp_activation, preset.block, preset.tied_embeddings) == ("relu", "parallel", True)


def _scenario(model: dict, **extra) -> dict:
    return {"name": "p", "pod": {"slice": "v5p-16", "mesh": {"fsdp": -1}}, "model": model,
            "training": {"global_batch": 8, "steps": 2}, "metrics": {"port": 0},
            "sweep": {"mode": "timing", "steps": 2}, **extra}


def test_a_preset_in_a_scenario_with_an_option_overridden():
    spec = pod.load(_scenario({"preset": "llama2-7b", "options": {"layers": 4}}))
    assert spec.model.name == "transformer" and spec.model.preset == "llama2-7b"
    options = spec.model.options
    assert options["layers"] == 4 and options["embed_dim"] == 4096 and options["mlp_dim"] == 11008
    assert spec.data.name == "synthetic_text"
    assert spec.data.options["vocabulary"] == 32000 and spec.data.options["sequence_length"] == 4096
    assert spec.data.options["num_examples"] >= 8 / 0.8
    again = pod.load(spec.model_dump())  # the expanded scenario reads back the same
    assert again == spec
    plan = pod.validate(_scenario({"preset": "llama2-7b", "options": {"layers": 2}},
                                  data={"name": "synthetic_text",
                                        "options": {"sequence_length": 256}}))
    c = PRESETS["llama2-7b"]
    assert plan.num_params == 2 * (2 * 4096 + 4 * 4096 ** 2 + 3 * 4096 * 11008) + 4096 \
        + 2 * c.vocabulary * 4096


def test_the_maxtext_scale_key_and_overrides_on_the_command_line():
    spec = pod.load(_scenario({"preset": "maxtext-2023", "global_parameter_scale": 32}))
    assert spec.model.preset == "maxtext-2023-s32" and spec.model.options["embed_dim"] == 10240
    spec = pod.load(_scenario({"preset": "llama3.1-8b"}), overrides=["model.options.kv_heads=32"])
    assert spec.model.options["kv_heads"] == 32


@pytest.mark.parametrize("model, needle", [
    ({"preset": "llama9"}, "model.preset: unknown preset 'llama9'; did you mean llama2-7b? presets:"),
    ({"preset": "llama2-7b", "name": "mlp"}, "model.name: a preset is a transformer (got 'mlp')"),
    ({"preset": "maxtext-2023-s32", "global_parameter_scale": 32},
     "model.global_parameter_scale: maxtext-2023-s32 already says s = 32"),
    ({"preset": "maxtext-2023", "global_parameter_scale": 24},
     "model.global_parameter_scale: must be a power of two"),
    ({"preset": "llama2-7b", "global_parameter_scale": 2},
     "model.global_parameter_scale: belongs to the maxtext-2023 preset"),
    ({"preset": "llama2-7b", "options": {"layerz": 2}}, "model.options: unknown option(s) 'layerz'"),
])
def test_preset_mistakes_are_one_line_naming_the_field(model, needle):
    with pytest.raises(ScenarioError) as err:
        pod.validate(_scenario(model))
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def test_describe_a_preset_by_name():
    code, out, err = _cli("describe", "llama3.1-8b")
    assert code == 0, err
    text = " ".join(out.split())
    assert "v5p-8: 4 chips" in text and "8,030,261,248" in text
    assert "HBM plan per device (pod.mesh {fsdp: 4}; global batch 4 = 1 per device; at its " in text
    code, out, err = _cli("describe", "mistral-7b", "pod.slice=v5e-16", "--json")
    assert code == 0, err
    assert '"name": "v5e-16"' in out and '"global_batch": 16' in out
    code, out, err = _cli("describe", "mixtral-8x7b")
    assert code == 0, err
    assert "1,451,270,144" in out  # a block: attention, 8 experts, router, norms
    code, _, err = _cli("describe", "lama3.1-8b")
    assert code == 2 and "not a chip" in err and "llama3.1-8b" in err


def test_preset_names_list_every_preset():
    assert set(PRESETS) <= set(preset_names()) and "maxtext-2023-s<N>" in preset_names()
    assert all(math.isfinite(p.published_params) for p in PRESETS.values())


def test_the_readme_table_shows_the_code_s_counts():
    """docs/scenarios.md "Model presets": each row's parameter count is the transformer's own."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "docs" / "scenarios.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9.-]+)` \|.*\| ([\d,]+) \(", readme, re.M))
    assert set(rows) >= set(DENSE) - {"maxtext-2023-s<N>"}
    for name in DENSE:
        assert int(rows[name].replace(",", "")) == _count(PRESETS[name]), name
    assert "32,548,136,960 (32.5B, T1)" in readme
    assert _count(maxtext_2023(32)) == 32_548_136_960
