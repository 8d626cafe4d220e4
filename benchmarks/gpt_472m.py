"""Entry file: the GPT fixture at the size measured on an H100 (/work/shared/measured/README.md):
n_embd 2048, 16 heads, 8 layers, block 1024, vocab 32768, batch 8; 472 M parameters.
Trace it with fake tensors (`--trace-mode fake`); it is too large to run here."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from gpt import GPT, GPTConfig  # noqa: E402


def build():
    return GPT(GPTConfig(block_size=1024, vocab_size=32768, n_layer=8, n_head=16, n_embd=2048))


def example_inputs():
    idx = torch.randint(0, 32768, (8, 1024))
    targets = torch.randint(0, 32768, (8, 1024))
    return (idx, targets)
