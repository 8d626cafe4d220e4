"""The cost model: contractions by FLOPs at their dtype's rate, everything else by bytes moved,
views and handed-back inputs at nothing, the precision option, and old device specs.

The h100-node spec is calibrated on per-op rows measured on one H100; these tests check what
the calibration does not fix by itself: how estimates scale with shape and dtype, a row no
figure was fitted on, and that the option reaches the plan's estimate."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.errors import UserError
from nnscaler_cst.plan.cost import (check_precision, is_contraction, load_cluster, moves_no_bytes, node_flops,
                                    node_time)
from nnscaler_cst.rewrite import PlanRequest, build_plan
from nnscaler_cst.rules_path import ENV_VAR

ROOT = Path(__file__).resolve().parents[1]

OPS = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Ops(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(HIDDEN, HIDDEN, dtype=DTYPE)

        def forward(self, x):
            y = self.proj(x)
            y.add_(1.0)
            z = F.dropout(y, 0.0, True)
            g = F.gelu(z)
            return g.view(-1).sum()


    def build():
        return Ops()


    def example_inputs():
        return (torch.randn(ROWS, HIDDEN, dtype=DTYPE),)
""")


_traced: dict[tuple, tuple] = {}


def _ops(tmp_path: Path, rows: int, hidden: int = 64, dtype: str = "torch.float32"):
    """The Ops model traced at a size: (graph, node by callee, analysis); each size traced once."""
    key = (rows, hidden, dtype)
    if key not in _traced:
        _traced[key] = _trace_ops(tmp_path, rows, hidden, dtype)
    return _traced[key]


def _trace_ops(tmp_path: Path, rows: int, hidden: int, dtype: str):
    path = tmp_path / f"ops_{rows}_{hidden}_{dtype[6:]}.py"
    path.write_text(OPS.replace("HIDDEN", str(hidden)).replace("ROWS", str(rows)).replace("DTYPE", dtype))
    analysis = analyze(path, trace_mode="fake")
    graph = analysis.graph
    return graph, {graph.nodes[i].callee: graph.nodes[i] for i in range(len(graph.nodes))}, analysis


def _time(graph, node, device, ways=1):
    return node_time(node, graph.dims.get(node.index), graph.trace, device, ways, dims_of=graph.dims.get)


def test_each_op_is_priced_by_what_bounds_it(tmp_path):
    graph, by_callee, _ = _ops(tmp_path, rows=64)
    trace = graph.trace
    linear, gelu = by_callee["torch.nn.Linear"], by_callee["torch.nn.functional.gelu"]
    assert is_contraction(linear, graph.dims.get(linear.index), trace)
    assert not is_contraction(gelu, graph.dims.get(gelu.index), trace)
    assert moves_no_bytes(by_callee["torch.nn.functional.dropout"], trace)   # p=0 hands its input back
    assert moves_no_bytes(by_callee["Tensor.view"], trace)                   # a view by torch's schema
    assert not moves_no_bytes(by_callee["Tensor.add_"], trace)               # in place: reads and writes
    device = load_cluster("h100-node").axis(1, 1)
    assert _time(graph, by_callee["Tensor.view"], device) == 0.0
    assert _time(graph, by_callee["Tensor.add_"], device) > 0.0


@pytest.mark.slow
def test_an_embedding_is_a_gather_not_a_matmul():
    graph = analyze(ROOT / "fixtures" / "gpt.py").graph
    embedding = next(n for n in graph.nodes if n.callee == "torch.nn.Embedding")
    assert not is_contraction(embedding, graph.dims.get(embedding.index), graph.trace)


CONVS = textwrap.dedent("""
    import torch
    import torch.nn as nn


    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.patches = nn.Conv2d(3, 16, kernel_size=8, stride=8)
            self.same = nn.Conv2d(16, 32, kernel_size=3, padding=1)
            self.proj = nn.Linear(32, 10)

        def forward(self, x):
            return self.proj(self.same(self.patches(x)).mean((2, 3))).sum()


    def build():
        return Convs()


    def example_inputs():
        return (torch.randn(2, 3, 64, 64),)
""")


def test_a_contraction_costs_its_output_times_what_each_output_element_sums(tmp_path):
    """A conv sums c·kh·kw products per output element; the input's spatial size, which the
    rule names too, is no factor (a strided patch embedding was priced at 2·n·c·h·w·o·kh·kw·ho·wo:
    Swin-H's at 131,325 s on a V100)."""
    path = tmp_path / "convs.py"
    path.write_text(CONVS)
    graph = analyze(path, trace_mode="fake").graph
    convs = [n for n in graph.nodes if n.callee == "torch.nn.Conv2d"]
    linear = next(n for n in graph.nodes if n.callee == "torch.nn.Linear")
    flops = [node_flops(n, graph.dims.get(n.index), graph.trace) for n in (*convs, linear)]
    assert flops == [2 * (2 * 16 * 8 * 8) * (3 * 8 * 8), 2 * (2 * 32 * 8 * 8) * (16 * 3 * 3), 2 * (2 * 10) * 32]


def test_a_memory_bound_op_scales_with_bytes_and_dtype(tmp_path):
    device = load_cluster("h100-node").axis(1, 1)
    small, small_ops, _ = _ops(tmp_path, rows=64)
    large, large_ops, _ = _ops(tmp_path, rows=256)
    half, half_ops, _ = _ops(tmp_path, rows=64, dtype="torch.bfloat16")
    gelu = "torch.nn.functional.gelu"
    base = _time(small, small_ops[gelu], device)
    assert _time(large, large_ops[gelu], device) == pytest.approx(4 * base)
    assert _time(half, half_ops[gelu], device) == pytest.approx(base / 2)
    assert _time(small, small_ops[gelu], device, ways=2) == pytest.approx(base / 2)


NO_GRAD = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Recycled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            with torch.no_grad():
                warm = F.gelu(self.proj(x))
            return F.gelu(self.proj(x + warm)).sum()


    def build():
        return Recycled()


    def example_inputs():
        return (torch.randn(32, 64),)
""")


def test_an_op_whose_outputs_need_no_gradient_is_priced_without_a_backward(tmp_path):
    """The same linear and gelu, once under no_grad (a recycling pass) and once with gradients:
    the no-grad ones cost their forward alone, the others forward and backward."""
    path = tmp_path / "recycled.py"
    path.write_text(NO_GRAD)
    graph = analyze(path, trace_mode="fake").graph
    device = load_cluster("h100-node").axis(1, 1)
    for callee in ("torch.nn.Linear", "torch.nn.functional.gelu"):
        no_grad, with_grad = [n for n in graph.nodes if n.callee == callee]
        forward = node_time(with_grad, graph.dims.get(with_grad.index), graph.trace, device, forward_only=True)
        assert _time(graph, no_grad, device) == pytest.approx(forward)
        assert _time(graph, with_grad, device) > 2 * forward


def test_a_bf16_matmul_is_faster_than_fp32_by_the_specs_ratio(tmp_path):
    spec = load_cluster("h100-node")
    graph, by_callee, _ = _ops(tmp_path, rows=4096, hidden=4096)
    linear = by_callee["torch.nn.Linear"]
    fp32 = _time(graph, linear, spec.axis(1, 1))
    bf16 = _time(graph, linear, spec.with_precision("bf16").axis(1, 1))
    flops = 3 * node_flops(linear, graph.dims.get(linear.index), graph.trace)
    rates = dict(spec.matmul_rates)
    overhead = 3 * spec.matmul_overhead
    assert fp32 - overhead == pytest.approx(flops / rates["fp32"])
    cast = bf16 - overhead - flops / rates["bf16"]       # autocast casts the fp32 input and weight to bf16
    assert 0 < cast < flops / rates["bf16"]
    assert (fp32 - overhead) / (bf16 - overhead - cast) == pytest.approx(rates["bf16"] / rates["fp32"])


def test_small_matmuls_run_below_the_rate_as_measured_on_a_row_not_fitted():
    """512x4096x4096 bf16 ran at 323 TFLOP/s on the H100 (/work/shared/measured/README.md); the
    spec's rate comes from the rows of 137 GFLOP and more, its overhead from the 1024^3 rows."""
    device = load_cluster("h100-node").axis(1, 1)
    rate = dict(device.matmul_rates)["bf16"]
    flops = 2 * 512 * 4096 * 4096
    predicted = flops / (device.matmul_overhead + flops / rate)
    assert predicted < 0.6 * rate
    assert predicted == pytest.approx(323e12, rel=0.25)
    big = 2 * 8192 ** 3
    assert big / (device.matmul_overhead + big / rate) > 0.95 * rate


def test_the_precision_option_changes_the_plans_estimate(tmp_path):
    _, _, analysis = _ops(tmp_path, rows=4096, hidden=4096)

    def estimate(cluster, precision):
        plan, _ = build_plan(analysis, PlanRequest(dp=1, cluster=cluster, precision=precision))
        return plan.estimated_step_seconds

    assert estimate("h100-node", "bf16") < estimate("h100-node", "tf32") < estimate("h100-node", None)
    # the CPU spec is measured (benchmarks/calibrate_cpu.py): bf16 is faster where the CPU has bf16 units
    cpu = load_cluster("cpu-gloo").axis(1, 1)
    bf16_faster = cpu.matmul_rate("bf16") > cpu.matmul_rate("fp32")
    assert (estimate("cpu-gloo", "bf16") < estimate("cpu-gloo", None)) == bf16_faster
    with pytest.raises(UserError, match="--precision fp8"):
        check_precision("fp8")


def test_a_spec_without_the_new_keys_still_loads_with_defaults_from_flops(tmp_path, monkeypatch):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "old.toml").write_text(
        '[device]\nname = "old"\nflops = 1e12\nmemory = 8e9\n'
        '[cluster]\ndevices_per_node = 8\nintra_bandwidth = 1e10\ninter_bandwidth = 1e9\nlatency = 1e-5\n')
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    device = load_cluster("old").axis(1, 2)
    assert device.matmul_rate("bf16") == device.matmul_rate("fp32") == 1e12
    assert device.bytes_per_second == 4e12
    assert device.matmul_overhead == 0.0
    assert device.seconds_per_param == pytest.approx(28 / 4e12)


def test_a_skinny_matmul_runs_below_the_rate_by_the_specs_half_rows(tmp_path):
    """matmul_half_rows: a contraction whose result has r rows runs at rate / (1 + half / r),
    r the fewer of its rows (the tokens) and columns (the features)."""
    from dataclasses import replace
    device = replace(load_cluster("h100-node").axis(1, 1), matmul_overhead=0.0, matmul_half_rows=64.0)
    per_flop = {}
    for rows in (16, 4096):
        graph, by_callee, _ = _ops(tmp_path, rows=rows, hidden=1024)
        linear = by_callee["torch.nn.Linear"]
        per_flop[rows] = _time(graph, linear, device) / node_flops(linear, graph.dims.get(linear.index), graph.trace)
    assert per_flop[16] / per_flop[4096] == pytest.approx((1 + 64 / 16) / (1 + 64 / 1024))


def test_every_op_that_moves_bytes_pays_the_specs_op_overhead(tmp_path):
    from dataclasses import replace
    graph, by_callee, _ = _ops(tmp_path, rows=8)
    device = load_cluster("h100-node").axis(1, 1)
    slow = replace(device, op_overhead=1e-3)
    gelu, view = by_callee["torch.nn.functional.gelu"], by_callee["Tensor.view"]
    # forward and the backward's 1.5 forwards each pay it; a view moves nothing and pays nothing
    assert _time(graph, gelu, slow) - _time(graph, gelu, device) == pytest.approx(2.5e-3)
    assert _time(graph, view, slow) == 0.0


def test_the_built_in_cpu_spec_is_the_calibration_scripts_output(monkeypatch):
    """rules/devices/cpu-gloo.toml is written by benchmarks/calibrate_cpu.py (the tests use their
    own fixed spec, tests/rules): it loads, with every figure the script measures."""
    monkeypatch.delenv(ENV_VAR)
    text = (ROOT / "rules" / "devices" / "cpu-gloo.toml").read_text()
    assert "benchmarks/calibrate_cpu.py" in text
    device = load_cluster("cpu-gloo").axis(1, 2)
    assert device.op_overhead > 0 and device.matmul_half_rows > 0 and device.matmul_overhead > 0
    assert device.optimizer_seconds_per_param is not None and device.memory_bandwidth is not None


ATTENTION = textwrap.dedent("""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v).sum()


    def build():
        return Attention()


    def example_inputs():
        return (torch.randn(2, TOKENS, 64),)
""")


def test_fused_attention_is_priced_by_the_flops_of_its_two_matmuls(tmp_path):
    """scaled_dot_product_attention moves b·h·t·d elements per operand but computes b·h·t·t·d
    twice (scores, then scores x values): its rule counts them (`flops` in rules/ops/torch.toml).
    Priced by bytes, a long sequence's attention cost next to nothing."""
    device = load_cluster("h100-node").axis(1, 1)
    seconds = {}
    for tokens in (128, 256):
        path = tmp_path / f"attention_{tokens}.py"
        path.write_text(ATTENTION.replace("TOKENS", str(tokens)))
        graph = analyze(path, trace_mode="fake").graph
        [node] = [n for n in graph.nodes if n.callee.endswith("scaled_dot_product_attention")]
        dims = graph.dims.get(node.index)
        assert is_contraction(node, dims, graph.trace)
        assert node_flops(node, dims, graph.trace) == 2 * 2 * (2 * 4 * tokens * tokens * 16)
        seconds[tokens] = _time(graph, node, device) - 3 * device.matmul_overhead
    assert seconds[256] / seconds[128] == pytest.approx(4.0)      # quadratic in the sequence


def test_attention_keeps_its_flops_when_the_search_refines_its_labels():
    """The search refines a label into factors where a neighbour sees finer structure (plan/
    refine.py); the rule's FLOPs count follows (it fell back to bytes, and Llama-7B's plans
    priced attention at nothing)."""
    from nnscaler_cst.plan.refine import refine_factors
    graph = analyze(ROOT / "fixtures" / "hf_llama.py").graph
    [node, *_] = [n for n in graph.nodes if n.callee.endswith("sdpa_attention_forward")]
    before = node_flops(node, graph.dims[node.index], graph.trace)
    refine_factors(graph)
    dims = graph.dims[node.index]
    assert any("." in label for label in dims.sizes()), "no label was refined: this tests nothing"
    assert is_contraction(node, dims, graph.trace) and node_flops(node, dims, graph.trace) == before


def test_an_embedding_lookup_costs_its_output_not_a_matmul_over_the_table(tmp_path):
    """The vocabulary is summed over in an embedding's dims (a split of it gives partial sums), but
    the ids pick one row per token: no contraction (is_contraction), so its FLOPs are the output's
    elements. Counted as 2 · output · vocabulary, a 2,048,000-row table weighed as much as the LM
    head in the stage balance, and 1F1B's cut left the embedding's stage nearly empty."""
    path = tmp_path / "lookup.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn


        class Lookup(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(1000, 8)
                self.proj = nn.Linear(8, 4)

            def forward(self, ids):
                return self.proj(self.embed(ids)).sum()


        def build():
            return Lookup()


        def example_inputs():
            return (torch.randint(0, 1000, (2, 3)),)
    """))
    graph = analyze(path, trace_mode="fake").graph
    lookup = next(n for n in graph.nodes if n.callee == "torch.nn.Embedding")
    linear = next(n for n in graph.nodes if n.callee == "torch.nn.Linear")
    assert node_flops(lookup, graph.dims.get(lookup.index), graph.trace) == 2 * 3 * 8
    assert node_flops(linear, graph.dims.get(linear.index), graph.trace) == 2 * (2 * 3 * 4) * 8
