"""Entry file for planning at scale: transformers' Llama at its 7B shape (32 layers, hidden 4096), batch
64 x 2048, use_cache off. Trace, plan and rewrite run on fake tensors at this size:
    nnscaler-rewrite plan benchmarks/llama_7b.py --plan auto --devices 64 --cluster h100-node --memory-budget 80GB
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    config = LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, use_cache=False,
    )
    return LlamaForCausalLM(config)


def example_inputs():
    input_ids = torch.randint(0, 32000, (64, 2048))
    return {"input_ids": input_ids, "labels": input_ids}
