"""Entry file for planning at scale: the GPT fixture (fixtures/gpt.py) at GPT-3 175B's shape
(Brown et al. 2020, Table 2.1): 96 layers, hidden 12288, 96 heads, sequence 2048, global batch
1536, the run Narayanan et al. (SC'21, Table 1) trained on 1536 A100s with TP 8 x PP 16 x DP 12.
The vocabulary is GPT-2's 50257 padded to 51200, as Megatron-LM pads it (a multiple of 128 x TP)
so that the embedding and the head split 8 ways. Traced on fake tensors only:
    nnscaler-rewrite plan benchmarks/gpt3_175b.py --plan auto --devices 1536 --cluster a100-node \\
        --precision bf16
`python benchmarks/bench_planning.py` compares the plan with Megatron-LM's configuration.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from gpt import GPT, GPTConfig  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQUENCE, BATCH, VOCAB = 96, 12288, 96, 2048, 1536, 51200


def build():
    return GPT(GPTConfig(block_size=SEQUENCE, vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN))


def example_inputs():
    idx = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
    targets = torch.randint(0, VOCAB, (BATCH, SEQUENCE))
    return (idx, targets)
