"""torch's recurrent layers (nn.LSTM, nn.GRU, nn.RNN) under tensor parallelism: split by hidden
units, each rank holding its units' rows of every gate block (torch's gate-major rows, so a
rank's rows are strided per gate), the recurrence run by `tp_recurrent` in the output's _comm.py
with an all-gather of the hidden state at every step. A projected LSTM stays whole.

Quick tests read the split rule, the runtime's step on a rank's rows and the cost model; one gloo
run (slow) verifies a model of all three layers at TP=2 against one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nnscaler_cst.analysis import analyze
from nnscaler_cst.graph.oprules import annotate
from nnscaler_cst.plan.cost import DeviceSpec, node_time
from nnscaler_cst.runtime._comm import Axis, _keep_slice, _recurrent_step

# a GRU over two layers, both directions, sequence first, no biases, from a given initial state;
# an LSTM batch first whose final states are read; an RNN (relu) started from them; a projected
# LSTM (left whole)
RECURRENT = """
    import torch
    from torch import nn


    class Recurrent(nn.Module):
        def __init__(self, vocab=16, dim=8):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.start = nn.Linear(dim, 4 * dim)
            self.gru = nn.GRU(dim, dim, num_layers=2, bidirectional=True, bias=False)
            self.lstm = nn.LSTM(2 * dim, dim, batch_first=True)
            self.rnn = nn.RNN(dim, dim, nonlinearity="relu", batch_first=True)
            self.projected = nn.LSTM(dim, 2 * dim, batch_first=True, proj_size=dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            h0 = self.start(x.mean(1)).view(x.shape[0], 4, -1).transpose(0, 1).contiguous()
            y, h_n = self.gru(x.transpose(0, 1), h0)
            z, (h, c) = self.lstm(y.transpose(0, 1))
            w, _ = self.rnn(z, h + c)
            p, _ = self.projected(w)
            return self.head(p + h_n.sum(0).unsqueeze(1))


    def build():
        torch.manual_seed(0)
        return Recurrent()


    def example_inputs():
        return (torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1)),)


    def loss(output):
        return output.float().pow(2).mean()
"""


def written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    return analyze(written(tmp_path_factory.mktemp("recurrent"), RECURRENT)).graph


def _layer(graph, callee: str):
    node = next(n for n in graph.nodes if n.callee == callee and n.callee_path != "projected")
    return node, graph.dims[node.index]


@pytest.mark.parametrize("callee, gates", [("torch.nn.GRU", 3), ("torch.nn.LSTM", 4), ("torch.nn.RNN", 1)])
def test_each_weight_splits_by_hidden_units_in_every_gate_block(recurrent, callee, gates):
    node, dims = _layer(recurrent, callee)
    weights = [name for name in dims.inputs if name.startswith("self.")]
    assert weights and all(dims.inputs[name].where("u") == (0, gates) for name in weights)
    assert dims.impl == {"u": "tp_recurrent({self}, {arg0}{rest1}, axis=TP)"}
    assert set(dims.splittable()) == {"u", "b"}


def test_the_batch_is_found_by_the_layers_batch_first_setting(recurrent):
    _, gru = _layer(recurrent, "torch.nn.GRU")          # sequence first: (T, B, 2H), h0 and h_n (4, B, H)
    assert gru.inputs["arg0"].where("b") == (1, 1) and gru.inputs["arg1"].where("b") == (1, 1)
    assert [o.where("b") for o in gru.outputs] == [(1, 1), (1, 1)]
    _, lstm = _layer(recurrent, "torch.nn.LSTM")        # batch first: (B, T, H); h_n, c_n (1, B, H)
    assert lstm.inputs["arg0"].where("b") == (0, 1)
    assert [o.where("b") for o in lstm.outputs] == [(0, 1), (1, 1), (1, 1)]


def test_a_projected_lstm_is_left_whole_with_the_reason(recurrent):
    node = next(n for n in recurrent.nodes if n.callee_path == "projected")
    rule, dims, problem = annotate(node, recurrent.trace, recurrent.rules)
    assert rule.name == "recurrent" and dims is None and "proj_size" in problem


@pytest.mark.parametrize("layer", [torch.nn.LSTM(6, 4), torch.nn.GRU(6, 4), torch.nn.RNN(6, 4)])
def test_a_ranks_gate_strided_rows_compute_its_units_of_a_step(layer):
    """What each of 2 ranks keeps of the whole layer (its rows of every gate block) computes its
    units of the layer's next state, from the whole input and state."""
    torch.manual_seed(0)
    x, h0, c0 = torch.randn(3, 6), torch.randn(3, 4), torch.randn(3, 4)
    state = (h0[None], c0[None]) if layer.mode == "LSTM" else h0[None]
    whole = layer(x[None], state)[0][0]
    gates = layer.weight_hh_l0.shape[0] // 4
    for rank in range(2):
        axis = Axis("tp", 2, rank)
        rows = {name: _keep_slice(getattr(layer, name).detach(), axis, 0, gates)
                for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")}
        mine = slice(2 * rank, 2 * rank + 2)
        h, _ = _recurrent_step(layer.mode, F.linear(x, rows["weight_ih_l0"], rows["bias_ih_l0"]),
                               F.linear(h0, rows["weight_hh_l0"], rows["bias_hh_l0"]), h0[:, mine], c0[:, mine])
        torch.testing.assert_close(h, whole[:, mine])


def test_the_split_prices_the_all_gather_of_every_step(recurrent):
    node, dims = _layer(recurrent, "torch.nn.GRU")
    # 2 layers x 2 directions x 5 steps all-gather (B, H); backward all-reduces the state of all
    # but the first step, and the upper layer's whole input once per direction
    assert dims.collectives == (("all_gather", 16, 20, False), ("all_reduce", 16, 16, True),
                                ("all_reduce", 160, 2, True))
    device = DeviceSpec()
    split = node_time(node, dims, recurrent.trace, device, 2, label="u")
    assert split - node_time(node, dims, recurrent.trace, device, 2) == pytest.approx(
        20 * (device.latency + 0.5 * 64 / device.bandwidth)
        + 16 * (device.latency + 64 / device.bandwidth) + 2 * (device.latency + 640 / device.bandwidth))


@pytest.mark.slow
def test_recurrent_layers_split_by_hidden_units_match_one_process(tmp_path):
    written(tmp_path, RECURRENT)
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "model.py", "--tp", "2",
                             "-o", "out"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout
    params = json.loads((tmp_path / "out" / "plan.json").read_text())["params"]
    assert params["lstm.weight_ih_l0"]["tp"] == params["lstm.weight_hh_l0"]["tp"] == "S(0, groups=4)"
    assert params["gru.weight_hh_l1_reverse"]["tp"] == "S(0, groups=3)" and params["rnn.weight_ih_l0"]["tp"] == "S(0)"
    assert params["projected.weight_hr_l0"]["tp"] == "R"
    code = (tmp_path / "out" / "model.py").read_text()
    assert code.count("tp_recurrent(self.") == 3 and "self.projected(" in code
