"""Entry file for the DGX-2 comparison (benchmarks/bench_dgx2.py): transformers' MBartForConditionalGeneration
at mBART-large's published configuration (Liu et al. 2020; facebook/mbart-large-cc25: d_model 1024, 12 encoder
and 12 decoder layers, 16 heads, FFN 4096, 1024 positions, vocabulary 250027 padded to 250112, a multiple of
128, so that the vocabulary splits over the pipeline and tensor-parallel ranks, as Megatron-LM pads it). One
embedding shared by the encoder, the decoder and the LM head. Sequence 1024, global batch 256 (the nnScaler
artifact's T5 setting; the paper's mBART batch was not found). Traced on fake tensors only.
"""
import torch
from transformers import MBartConfig, MBartForConditionalGeneration

VOCAB, SEQUENCE, BATCH = 250112, 1024, 256


def build():
    config = MBartConfig(vocab_size=VOCAB, d_model=1024, encoder_layers=12, decoder_layers=12,
                         encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                         decoder_ffn_dim=4096, max_position_embeddings=1024, dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0, scale_embedding=True, pad_token_id=1, decoder_start_token_id=2)
    return MBartForConditionalGeneration(config)


def example_inputs():
    ids = torch.randint(3, VOCAB, (BATCH, SEQUENCE))
    return {"input_ids": ids, "labels": ids}
