"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): transformers' T5ForConditionalGeneration
at the nnScaler artifact's T5 setting (microsoft/nnscaler cupilot/evaluation/t5_32gpus.sh and
cupilot/examples/t5/train.py: --layers 32 encoder and 32 decoder layers, --hidden 6144, --heads 96 (d_kv
6144 / 96 = 64), d_ff 4 x hidden = 24576, --seqlen 1024, --vocab 2048 x 1000 = 2,048,000, --gbs 256 in
micro-batches of 1; one embedding weight shared by both embeddings and the head, as the artifact's `embedw`).
The artifact's own T5 has learned positions, LayerNorm, a gelu MLP with biases and `loss = sum(logits)`;
transformers' has relative position buckets, RMSNorm, a relu MLP without biases and a cross entropy: the
same matmuls and parameters but for the biases and the position tables. DGX2_T5_VOCAB sets the vocabulary
(the benchmark's sweep). Traced on fake tensors only:
    nnscaler-rewrite plan benchmarks/dgx2_t5_artifact.py --tp 8 --cluster dgx2-v100x32 --precision fp16
"""
import os

import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = int(os.environ.get("DGX2_T5_VOCAB", 2048 * 1000))
SEQUENCE, BATCH = 1024, 256


def build():
    config = T5Config(vocab_size=VOCAB, d_model=6144, d_kv=64, d_ff=4 * 6144, num_layers=32, num_decoder_layers=32,
                      num_heads=96, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def example_inputs():
    ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    return {"input_ids": ids, "labels": ids}
