"""The model summary table (``pod.report.model_summary``) of a model whose layers also
spend time on the host link (remat offload): its total row sums every row, the host's
seconds too (describe of T5 / T6, which offload, raised KeyError 'host_seconds')."""

from __future__ import annotations

from chip import get_chip_spec
from pod.report.model_summary import layer_costs, model_summary_table
from pod.workloads import build_model


def test_the_total_of_an_offloading_model_sums_its_host_seconds_too():
    model = build_model("transformer", (16,), 40, embed_dim=16, heads=4, head_dim=4,
                        mlp_dim=32, layers=2, remat="custom",
                        remat_custom={"decoder_layer_input": "offload"})
    core = get_chip_spec("v6e").core
    costs = layer_costs(model, core, 2)
    host = sum(c.get("host_seconds", 0.0) for c in costs.values())
    assert host > 0                                   # the blocks' offloads and reloads
    table = model_summary_table(model, core, 2)
    assert table.row_count == len(model.layers) + 2   # the layers, the loss, the total
