"""A call's derived split rule holds at every size (graph/derive.py `at_small_shape`): a call too
large to probe at its traced shape is probed at a small shape of itself, and the labels found
there are its labels at the production shape. So a model that splits its batch at a tiny shape
keeps data parallelism and micro-batches at its real one.
"""
from __future__ import annotations

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.graph import derive
from nnscaler_cst.plan.batch import batch_split_problem
from nnscaler_cst.rewrite import PlanRequest, build_plan

HELPER = '''
def mix_heads(q, k, v, heads):
    b, t, c = q.shape
    q, k, v = (x.view(b, t, heads, c // heads).transpose(1, 2) for x in (q, k, v))
    att = (q @ k.transpose(-1, -2)).softmax(-1)
    return (att @ v).transpose(1, 2).reshape(b, t, c)
'''

HELPER_MODEL = '''
import torch
import torch.nn as nn
from small_probe_helpers import mix_heads


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=-1)
        return self.out(mix_heads(q, k, v, 4)).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(8, 12, 16),)
'''


def _helper_dims(graph):
    node = next(n for n in graph.nodes if n.callee.endswith("mix_heads"))
    return node, graph.dims.get(node.index), graph.problems.get(node.index)


def test_a_call_too_large_to_probe_keeps_the_labels_of_a_small_shape_of_itself(tmp_path, monkeypatch):
    (tmp_path / "small_probe_helpers.py").write_text(HELPER.lstrip())
    model = tmp_path / "model.py"
    model.write_text(HELPER_MODEL.lstrip())
    _, whole, _ = _helper_dims(analyze(model).graph)
    assert whole is not None and any(t.labels() for t in whole.inputs.values())
    monkeypatch.setattr(derive, "MAX_PROBE_ELEMENTS", 64)       # every activation is now too large
    node, small, problem = _helper_dims(analyze(model).graph)
    assert small is not None, problem
    assert small == whole                                       # same labels on the same operand dims


T5 = '''
import torch
from transformers import T5Config, T5ForConditionalGeneration


def build():
    return T5ForConditionalGeneration(T5Config(
        vocab_size=32128, d_model=256, d_kv=32, d_ff=512, num_layers=2, num_decoder_layers=2, num_heads=8,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def example_inputs():
    ids = torch.randint(3, 32128, (128, 256))
    return {"input_ids": ids, "labels": ids}
'''

BART = '''
import torch
from transformers import BartConfig, BartForConditionalGeneration


def build():
    return BartForConditionalGeneration(BartConfig(
        vocab_size=50272, d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=256,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def example_inputs():
    ids = torch.randint(3, 50272, (128, 256))
    return {"input_ids": ids, "labels": ids}
'''


@pytest.mark.parametrize("source", [T5, BART], ids=["t5", "bart"])
def test_encoder_decoders_at_production_shape_keep_data_parallelism_and_micro_batches(tmp_path, source):
    model = tmp_path / "model.py"
    model.write_text(source.lstrip())
    analysis = analyze(model)
    graph = analysis.graph
    assert analysis.trace.mode == "fake"
    attention = [n for n in graph.nodes if n.callee.endswith("sdpa_attention_forward")]
    assert attention and derive.too_large_to_probe(analysis.trace, attention[0].inputs)   # a production shape
    assert all(n.index in graph.dims for n in attention), [graph.problems.get(n.index) for n in attention]
    assert batch_split_problem(graph, "data parallel (--dp 2)") is None
    assert batch_split_problem(graph, "micro-batches (--micro-batches 2)", across_ranks=False) is None
    plan, _ = build_plan(analysis, PlanRequest(tp=2, dp=2, cluster="dgx2-v100x32"))
    assert plan.mesh["dp"] == 2 and plan.estimated_step_seconds > 0
