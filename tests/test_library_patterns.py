"""Spec: patterns of models from libraries other than transformers, each on a model written here.

- torch.nn's own transformer layers: `nn.TransformerEncoderLayer`'s feed-forward is split like
  any block's (column then row), in a mirror of torch's file (`_torch/nn/modules/transformer.py`),
  and `nn.TransformerEncoder`'s loop over its cloned layers is cut into pipeline stages.
- `nn.Transformer`: the encoder's layers, then the decoder's, cut as one chain of blocks; the
  decoder's code before its loop reads its first layer (`self.layers[0].self_attn.batch_first`),
  so no stage boundary falls at the decoder's first block (`--stages` there is refused at that line).
- `nn.MultiheadAttention` called directly, sequence-first and batch-first, with a causal and a
  padding mask, averaged attention weights (need_weights=True) and a cross-attention whose keys
  have their own width (kdim) returning its weights per head (split with the heads): split by heads (the in-projection's rows of each of q, k, v, the
  out-projection's columns), run by _comm's tp_multi_head_attention_forward.
- x-transformers' style: each layer a ModuleList of [norm, block, residual] whose modules the loop
  calls (never the layer itself): pipelining is refused at that loop, with the reason.
- timm's ViT style: the blocks run in one branch of an `if` whose other branches run them
  another way (`checkpoint_seq(self.blocks, x)`, a loop with a mask), and the model holds
  parameters of its own (`cls_token`, `pos_embed`) that only the first stage reads.
- torchvision's MobileNet style: one line (`self.block(x)`) calls an nn.Sequential whose layers
  differ from block to block (with and without an expansion layer). Its layers cannot be cut
  apart in that line: under TP they run whole, with a warning saying why; under DP its
  BatchNorm layers sum their statistics over the ranks as the container runs.
- torchvision's ResNet style: both convs of a block are built by one helper (`conv3x3(in_planes,
  out_planes)`), the first split by its output channels, the second by its input: the helper's
  one `nn.Conv2d(...)` cannot be divided for both, so its calls are (`conv3x3(c, c // 2)`).
- diffusers' ResnetBlock2D style: two convs with biases in a block, split as Megatron splits an
  MLP: the first by its output channels, the second by its input channels, its partial sums
  reduced and its bias added once after, broadcast over the spatial dims (`bias[:, None, None]`).
- timm's BEiT style: the attention adds a learned relative-position bias to its scores, a table of
  [relative distances, heads] indexed by a buffer of each query-key pair's distance, viewed and
  permuted to [1, heads, N, N] and passed to scaled_dot_product_attention as its mask: under TP
  the table is split by its heads column and the bias reaches the attention split by heads, as
  the queries are (no all-gather of it).
Quick tests read the plan and the written code; the gloo runs are slow.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TIMEOUT_S = 600

TORCH_ENCODER = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class TinyEncoder(nn.Module):
        def __init__(self, vocab=64, d_model=32, nhead=4, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, idx, targets):
            logits = self.head(self.encoder(self.embed(idx)))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


    def build():
        torch.manual_seed(0)
        return TinyEncoder()


    def example_inputs():
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
"""

TORCH_TRANSFORMER = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class TinySeq2Seq(nn.Module):
        def __init__(self, vocab=64, d_model=32, nhead=4, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.transformer = nn.Transformer(d_model, nhead, layers, layers, dim_feedforward=64, dropout=0.0,
                                              batch_first=True)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, src, tgt, targets):
            mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            out = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True)
            logits = self.head(out)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


    def build():
        torch.manual_seed(0)
        return TinySeq2Seq()


    def example_inputs():
        g = torch.Generator().manual_seed(1)
        return (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 6), generator=g),
                torch.randint(0, 64, (4, 6), generator=g))
"""

MULTIHEAD = """
    import torch
    import torch.nn as nn


    class Block(nn.Module):
        def __init__(self, d=16, h=4, kd=12):
            super().__init__()
            self.self_attn = nn.MultiheadAttention(d, h)                                      # (L, N, E)
            self.cross = nn.MultiheadAttention(d, h, kdim=kd, vdim=kd, batch_first=True)      # q, k, v apart
            self.up = nn.Linear(d, 2 * d)
            self.down = nn.Linear(2 * d, d)

        def forward(self, x, memory, causal, padding):
            t = x.transpose(0, 1)
            a, weights = self.self_attn(t, t, t, attn_mask=causal, key_padding_mask=padding)   # averaged weights
            x = x + a.transpose(0, 1) + weights.sum(-1, keepdim=True)
            c, per_head = self.cross(x, memory, memory, average_attn_weights=False)   # (N, heads, L, S)
            x = x + c + per_head[:, :, :, :2].sum((1, 3)).unsqueeze(-1)
            return x + self.down(torch.relu(self.up(x)))


    class Model(nn.Module):
        def __init__(self, n=2):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(n))
            self.proj = nn.Linear(16, 4)

        def forward(self, x, memory, y):
            causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            padding = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
            padding[:, -1] = True
            for blk in self.blocks:
                x = blk(x, memory, causal, padding)
            return nn.functional.mse_loss(self.proj(x), y)


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        torch.manual_seed(1)
        return torch.randn(4, 8, 16), torch.randn(4, 6, 12), torch.randn(4, 8, 4)
"""

NESTED_LAYER_LISTS = """
    import torch
    import torch.nn as nn


    class Residual(nn.Module):
        def forward(self, out, residual):
            return out + residual


    class Model(nn.Module):
        def __init__(self, d=16, n=4):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, d), Residual()])
                                         for _ in range(n)])
            self.head = nn.Linear(d, 4)

        def forward(self, x, y):
            for norm, block, residual in self.layers:
                x = residual(block(norm(x)), x)
            return nn.functional.mse_loss(self.head(x), y)


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        torch.manual_seed(1)
        return torch.randn(4, 8, 16), torch.randn(4, 8, 4)
"""

BRANCHED_VIT = """
    import torch
    import torch.nn as nn


    def run_in_checkpoints(blocks, x):
        return torch.utils.checkpoint.checkpoint_sequential(blocks, len(blocks), x, use_reentrant=False)


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.fc1 = nn.Linear(dim, 2 * dim)
            self.fc2 = nn.Linear(2 * dim, dim)

        def forward(self, x, scale=1.0):
            return x + scale * self.fc2(torch.relu(self.fc1(self.norm(x))))


    class TinyViT(nn.Module):
        def __init__(self, dim=16, depth=4, patch=4, classes=10):
            super().__init__()
            self.patch_embed = nn.Conv2d(3, dim, patch, patch)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
            self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, classes)
            self.grad_checkpointing = False

        def forward_features(self, x, scale=None):
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            if scale is not None:
                for blk in self.blocks:
                    x = blk(x, scale)
            elif self.grad_checkpointing:
                x = run_in_checkpoints(self.blocks, x)
            else:
                x = self.blocks(x)
            return self.norm(x)

        def forward(self, x):
            return self.head(self.forward_features(x)[:, 0])


    def build():
        torch.manual_seed(0)
        return TinyViT()


    def example_inputs():
        return (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


    def loss(output):
        return output.pow(2).mean()
"""


MIXED_BLOCKS = """
    import torch
    from torch import nn


    def conv_bn(cin, cout, k=1, groups=1, act=True):
        layers = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act:
            layers.append(nn.ReLU())
        return nn.Sequential(*layers)


    class InvertedResidual(nn.Module):
        def __init__(self, c, expand):
            super().__init__()
            hidden = c * expand
            layers = [conv_bn(c, hidden)] if expand != 1 else []
            layers += [conv_bn(hidden, hidden, 3, groups=hidden), conv_bn(hidden, c, act=False)]
            self.block = nn.Sequential(*layers)

        def forward(self, x):
            return x + self.block(x)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.blocks = nn.Sequential(InvertedResidual(8, 1), InvertedResidual(8, 2))
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)).mean((2, 3))).square().mean()


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)
"""


HELPER_BUILT_CONVS = """
    import torch
    from torch import nn


    def conv3x3(in_planes, out_planes, stride=1):
        return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


    class BasicBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1 = conv3x3(c, c)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = conv3x3(c, c)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + x)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.layer = nn.Sequential(BasicBlock(8), BasicBlock(8))
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(self.layer(self.stem(x)).mean((2, 3))).square().mean()


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)
"""


CONV_BLOCKS_WITH_BIASES = """
    import torch
    from torch import nn


    class ResnetBlock(nn.Module):
        def __init__(self, c, hidden):
            super().__init__()
            self.norm = nn.GroupNorm(4, c)
            self.conv1 = nn.Conv2d(c, hidden, 3, padding=1)
            self.conv2 = nn.Conv2d(hidden, c, 3, padding=1)

        def forward(self, x):
            h = self.conv1(torch.nn.functional.silu(self.norm(x)))
            return x + self.conv2(torch.nn.functional.silu(h))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.blocks = nn.ModuleList([ResnetBlock(8, 16), ResnetBlock(8, 16)])

        def forward(self, x):
            h = self.stem(x)
            for block in self.blocks:
                h = block(h)
            return h.square().mean()


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)
"""


# torchvision's IntermediateLayerGetter: one line in a loop over the children calls an
# nn.Sequential one time and a block with its own forward the next
LOOP_OVER_CHILDREN = """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            return x + torch.relu(self.bn(self.conv(x)))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stages = nn.ModuleDict({"stem": nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)),
                                         "block": Block(8)})
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            for name, module in self.stages.items():
                x = module(x)
            return self.head(x.mean((2, 3))).square().mean()


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1)),)
"""


RELATIVE_POSITION_BIAS = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Attention(nn.Module):
        def __init__(self, dim, heads, tokens):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.bias_table = nn.Parameter(torch.randn(2 * tokens - 1, heads) * 0.5)   # [distances, heads]
            position = torch.arange(tokens)
            self.register_buffer("distance", position[:, None] - position[None, :] + tokens - 1, persistent=False)

        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            bias = self.bias_table[self.distance.view(-1)].view(N, N, -1)
            bias = bias.permute(2, 0, 1).contiguous().unsqueeze(0)     # [1, heads, N, N]
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.proj(x.transpose(1, 2).reshape(B, N, C))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Attention(16, 4, 6), Attention(16, 4, 6)])

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()


    def build():
        torch.manual_seed(0)
        return Model()


    def example_inputs():
        return (torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1)),)
"""

def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def written(tmp_path: Path, text: str) -> Path:
    (tmp_path / "model.py").write_text(textwrap.dedent(text).lstrip("\n"))
    return tmp_path


def test_torch_encoder_layers_split_their_feed_forward(tmp_path):
    root = written(tmp_path, TORCH_ENCODER)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    for layer in (0, 1):
        assert params[f"encoder.layers.{layer}.linear1.weight"]["tp"] == "S(0)"
        assert params[f"encoder.layers.{layer}.linear2.weight"]["tp"] == "S(1)"
    mirror = (root / "out" / "_torch" / "nn" / "modules" / "transformer.py").read_text()
    assert "self.linear1 = Linear(d_model, dim_feedforward // 2, bias=bias, **factory_kwargs)" in mirror
    assert "tp_reduce(" in mirror and "class TransformerDecoderLayer" not in mirror
    assert "from ._torch.nn.modules.transformer import TransformerEncoderLayer" in (root / "out" / "model.py").read_text()


def test_multihead_attention_is_split_by_heads(tmp_path):
    root = written(tmp_path, MULTIHEAD)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    expected = {"self_attn.in_proj_weight": "S(0, groups=3)", "self_attn.in_proj_bias": "S(0, groups=3)",
                "self_attn.out_proj.weight": "S(1)", "self_attn.out_proj.bias": "R",
                "cross.q_proj_weight": "S(0)", "cross.k_proj_weight": "S(0)", "cross.v_proj_weight": "S(0)"}
    for layer in (0, 1):
        assert {k: params[f"blocks.{layer}.{k}"]["tp"] for k in expected} == expected
    mirror = (root / "out" / "_torch" / "nn" / "modules" / "activation.py").read_text()
    assert "torch.empty((3 * embed_dim // 2, embed_dim), **factory_kwargs)" in mirror
    assert "embed_dim // 2, embed_dim, bias=bias, **factory_kwargs" in mirror      # out_proj: its input by heads
    assert mirror.count("tp_multi_head_attention_forward(") == 2 and "axis=TP)" in mirror   # both calls of F
    assert "F.multi_head_attention_forward(" not in mirror


def test_cloned_layers_keep_their_constructor_sites_on_real_tensors(tmp_path):
    """nn.TransformerEncoder deep-copies its layer; traced on real tensors (where the fake trace
    fails) the copies' parameters are made where the original's were, so they split alike."""
    from nnscaler_cst.analysis import analyze
    trace = analyze(written(tmp_path, TORCH_ENCODER) / "model.py", trace_mode="real").trace
    lines, start = inspect.getsourcelines(torch.nn.TransformerEncoderLayer.__init__)
    line = start + next(i for i, text in enumerate(lines) if "self.linear1 = Linear(" in text)
    for layer in (0, 1):
        info = trace.params[f"encoder.layers.{layer}.linear1.weight"]
        assert (info.ctor_span.line, info.module_type) == (line, "torch.nn.Linear")


def test_torch_encoder_loop_is_cut_into_stages(tmp_path):
    root = written(tmp_path, TORCH_ENCODER)
    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    mirror = (root / "out" / "_torch" / "nn" / "modules" / "transformer.py").read_text()
    assert "class TransformerEncoder(Module)" in mirror and "pp_handoff(" in mirror
    assert 'PIPELINE_BLOCKS = "encoder.layers"' in (root / "out" / "model_stage0.py").read_text()


@pytest.mark.slow     # over 10 s: keeps the quick subset under 3 minutes
def test_torch_transformer_is_cut_as_a_chain_with_a_decoder_block_where_the_decoder_starts(tmp_path):
    root = written(tmp_path, TORCH_TRANSFORMER)
    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    first = (root / "out" / "model_stage0.py").read_text()
    assert "PIPELINE_BLOCKS = ['transformer.encoder.layers', 'transformer.decoder.layers']" in first
    blocks = ast.literal_eval(first.split("STAGE_BLOCKS = ")[1].split("  #")[0])[0]
    assert blocks["transformer.encoder.layers"] != (0, 2) or blocks["transformer.decoder.layers"][1] > 0

    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "--stages", "2", "-o", "out2", cwd=root)
    assert result.returncode == 2 and not (root / "out2").exists()
    lines, start = inspect.getsourcelines(torch.nn.TransformerDecoder.forward)
    line = start + next(i for i, text in enumerate(lines) if "self.layers[0]" in text)
    assert f"transformer.py:{line}:" in result.stderr and "--stages cuts at block 2, the first of " \
        "transformer.decoder.layers, whose code before its loop reads its blocks here" in result.stderr, result.stderr


def test_blocks_run_in_branches_and_model_parameters_stay_on_the_first_stage(tmp_path):
    root = written(tmp_path, BRANCHED_VIT)
    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    first, last = ((root / "out" / f"model_stage{s}.py").read_text() for s in (0, 1))
    assert "# pipeline: each branch runs this stage's blocks of blocks only" in first
    assert "TIED_PARAMETERS = []" in first and "TIED_PARAMETERS = []" in last   # cls_token: stage 0 only


def test_a_branch_that_counts_the_blocks_is_refused(tmp_path):
    root = written(tmp_path, BRANCHED_VIT.replace("for blk in self.blocks:", "for i, blk in enumerate(self.blocks):"))
    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "-o", "out", cwd=root)
    assert result.returncode == 2
    line = (root / "model.py").read_text().splitlines().index("            for i, blk in enumerate(self.blocks):") + 1
    assert f"model.py:{line}:13: error:" in result.stderr and "not nested" in result.stderr
    assert not (root / "out").exists()


@pytest.mark.slow     # over 10 s: keeps the quick subset under 3 minutes
def test_a_line_calling_blocks_built_differently_runs_their_layers_whole(tmp_path):
    root = written(tmp_path, MIXED_BLOCKS)
    result = cli("model.py", "--dp", "2", "-o", "dp", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "return x + dp_layers(self.block, x, DP)  # each BatchNorm it runs sums its statistics over the " \
           "data-parallel ranks" in (root / "dp" / "model.py").read_text()
    result = cli("model.py", "--tp", "2", "-o", "tp", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "model.py:21:20: warning: torch.nn.Conv2d keeps its weights whole on every tensor-parallel rank: it runs " \
           "in an nn.Sequential called at model.py:21:20 whose calls run different layers" in result.stderr
    assert "self.block[" not in (root / "tp" / "model.py").read_text()


def test_a_line_calling_a_sequential_and_another_module_in_a_loop_is_not_cut_by_the_first(tmp_path):
    root = written(tmp_path, LOOP_OVER_CHILDREN)
    result = cli("model.py", "--dp", "2", "-o", "dp", cwd=root)      # its dry run runs both calls
    assert result.returncode == 0, result.stderr
    code = (root / "dp" / "model.py").read_text()
    assert "x = dp_layers(module, x, DP)" in code and "module[1]" not in code


def test_convs_a_helper_builds_split_unalike_are_divided_at_the_helper_calls(tmp_path):
    root = written(tmp_path, HELPER_BUILT_CONVS)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "stays whole" not in result.stderr
    code = (root / "out" / "model.py").read_text()
    assert "self.conv1 = conv3x3(c, c // 2)  # out_planes / 2" in code
    assert "self.conv2 = conv3x3(c // 2, c)  # in_planes / 2" in code
    assert "return nn.Conv2d(in_planes, out_planes, kernel_size=3" in code      # the helper as it was
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    assert params["layer.0.conv1.weight"]["tp"] == "S(0)" and params["layer.0.conv2.weight"]["tp"] == "S(1)"


def test_a_conv_with_a_bias_splits_by_input_channels_and_adds_its_bias_once(tmp_path):
    root = written(tmp_path, CONV_BLOCKS_WITH_BIASES)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "Conv2d is not split by heads or hidden" not in result.stderr
    code = (root / "out" / "model.py").read_text()
    assert "self.conv2 = nn.Conv2d(hidden // 2, c, 3, padding=1)  # in_channels / 2" in code
    assert "return x + (tp_reduce(torch.nn.functional.conv2d(torch.nn.functional.silu(h), self.conv2.weight, None, " \
           "self.conv2.stride, self.conv2.padding, self.conv2.dilation, self.conv2.groups), TP) + " \
           "self.conv2.bias[:, None, None])" in code


def test_layers_that_are_lists_of_modules_are_refused_for_pipelining_at_their_loop(tmp_path):
    root = written(tmp_path, NESTED_LAYER_LISTS)
    result = cli("model.py", "--pp", "2", "--micro-batches", "2", "-o", "out", cwd=root)
    assert result.returncode == 2 and not (root / "out").exists()
    line = (root / "model.py").read_text().splitlines().index("        for norm, block, residual in self.layers:") + 1
    assert f"model.py:{line}:9: error: the blocks of layers are lists of modules, never called themselves" \
        in result.stderr, result.stderr


def test_a_relative_position_bias_table_is_split_by_heads_with_the_attention(tmp_path):
    root = written(tmp_path, RELATIVE_POSITION_BIAS)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    assert params["blocks.0.bias_table"]["tp"] == "S(1)"
    code = (root / "out" / "model.py").read_text()
    assert "self.bias_table = nn.Parameter(torch.randn(2 * tokens - 1, heads // 2) * 0.5)" in code
    assert "tp_gather(" not in code and "F.scaled_dot_product_attention(q, k, v, attn_mask=bias)" in code

@pytest.mark.slow
@pytest.mark.parametrize("model,mode", [(TORCH_ENCODER, ("--tp", "2")),
                                        (MULTIHEAD, ("--tp", "2", "--dp", "2")),
                                        (TORCH_ENCODER, ("--pp", "2", "--micro-batches", "2")),
                                        (BRANCHED_VIT, ("--pp", "2", "--micro-batches", "2")),
                                        (MIXED_BLOCKS, ("--dp", "2", "--tp", "2")),
                                        (HELPER_BUILT_CONVS, ("--tp", "2")),
                                        (CONV_BLOCKS_WITH_BIASES, ("--tp", "2")),
                                        (RELATIVE_POSITION_BIAS, ("--tp", "2"))],
                         ids=["torch-encoder-tp2", "multihead-attention-dp2xtp2", "torch-encoder-pp2",
                              "branched-vit-pp2", "mixed-blocks-dp2xtp2", "helper-built-convs-tp2",
                              "conv-blocks-with-biases-tp2", "relative-position-bias-tp2"])
def test_verifies(tmp_path, model, mode):
    root = written(tmp_path, model)
    result = cli("verify", "model.py", *mode, "-o", "out", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout


# diffusers' FeedForward: `for module in self.net: hidden_states = module(hidden_states)` over a
# list of torch's layers (a projection, an activation, a projection), one line for all of them.
LOOP_OVER_LAYERS = '''
import torch
import torch.nn as nn


class FeedForward(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)])

    def forward(self, x):
        for module in self.net:
            x = module(x)
        return x


class Model(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ff = FeedForward(d)

    def forward(self, x):
        return self.ff(x).pow(2).mean()


def build():
    return Model()


def example_inputs():
    return (torch.randn(4, 16),)
'''


@pytest.mark.slow     # a rewrite and its replan: over 10 s
def test_a_line_whose_instances_need_their_argument_converted_unalike_plans_their_layers_whole(tmp_path):
    root = written(tmp_path, LOOP_OVER_LAYERS)
    result = cli("model.py", "--tp", "2", "-o", "out", cwd=root)
    assert result.returncode == 0, result.stderr
    assert "model.py:12:17: warning: ff.net.0.bias (and 1 more) stays whole on every tensor-parallel rank: the plan " \
           "that split it could not be written (instances of torch.nn.GELU need different conversions" in result.stderr
    params = json.loads((root / "out" / "plan.json").read_text())["params"]
    assert params["ff.net.0.weight"]["tp"] == "R"
