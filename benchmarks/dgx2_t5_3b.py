"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): transformers' T5ForConditionalGeneration
at T5-3B's published configuration (Raffel et al. 2020; the t5-3b config: d_model 1024, d_kv 128, d_ff 16384,
24 encoder and 24 decoder layers, 32 heads, vocabulary 32128; one embedding shared by the encoder, the
decoder and the LM head as transformers ties them). Sequence 1024 and global batch 256 as the nnScaler
artifact's T5 runs (microsoft/nnscaler cupilot/evaluation/t5_32gpus.sh: --seqlen 1024, GBS=256).
Traced on fake tensors only:
    nnscaler-rewrite schedule benchmarks/dgx2_t5_3b.py --pp 4 --micro-batches 16 --schedule interlaced
"""
import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB, SEQUENCE, BATCH = 32128, 1024, 256


def build():
    config = T5Config(vocab_size=VOCAB, d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_decoder_layers=24,
                      num_heads=32, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def example_inputs():
    ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    return {"input_ids": ids, "labels": ids}
