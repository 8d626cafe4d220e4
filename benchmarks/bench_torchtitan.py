#!/usr/bin/env python
"""torchtitan's published Llama 3.1 8B runs, priced by the tool's cost model.

    python benchmarks/bench_torchtitan.py

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (end of 2024, H100s on Grand Teton, 8 per
host on NVLink, 400 Gb/s RDMA per GPU) reports for Llama 3.1 8B, 1D FSDP, local batch 2, selective
activation checkpointing, bf16, no torch.compile: 5,762 tokens/s per GPU on 8 GPUs (Table 1) and
5,605 on 128 (Table 3); 33-39% MFU by their note. Sequence length: torchtitan's llama3_8b config,
8192. For each device count (8, 64, 128) this traces transformers' Llama at the 8B shape on fake
tensors with the global batch (2 per device x 8192 tokens) and prices, on rules/devices/h100-node.toml
in bf16 (plan/auto.py's estimate_config):

* their configuration as the tool can express it: dp = N, ZeRO-3 (FSDP), recompute of every block
  (full activation checkpointing: the tool has no selective recompute, so it reruns more);
* what `--plan auto` picks for N devices under their memory (96 GB HBM2e per GPU).

MFU = (6 x non-embedding parameters + 12 x layers x hidden x sequence) FLOPs per token x tokens/s
per GPU / 989 TFLOP/s (H100 SXM bf16 dense), the formula torchtitan uses; their published MFU is
computed the same way from their tokens/s here (the table's 33-39% is their note, compile included).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ = 8192
LOCAL_BATCH = 2
PEAK = 989e12
PUBLISHED = {8: 5762, 128: 5605}      # tokens/s per GPU, FSDP, no compile, no Float8
SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8)

ENTRY = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    return LlamaForCausalLM(LlamaConfig(**{shape}, max_position_embeddings={seq}, rope_theta=500000.0,
                                        use_cache=False, tie_word_embeddings=False))


def example_inputs():
    input_ids = torch.randint(0, {vocab}, ({batch}, {seq}))
    return {{"input_ids": input_ids, "labels": input_ids}}
'''


def flops_per_token() -> float:
    h, layers, ffn, vocab = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["intermediate_size"], \
        SHAPE["vocab_size"]
    kv = h * SHAPE["num_key_value_heads"] // SHAPE["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * ffn + 2 * h       # q, o; k, v; gate, up, down; norms
    non_embedding = layers * per_layer + h + h * vocab               # final norm, output head
    return 6 * non_embedding + 12 * layers * h * SEQ


def main() -> None:
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.plan.auto import Config, estimate_config, search_auto
    from nnscaler_cst.plan.cost import load_cluster
    cluster = load_cluster("h100-node").with_precision("bf16")
    per_token = flops_per_token()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices in (8, 64, 128):
            batch = LOCAL_BATCH * devices
            path = Path(tmp) / f"llama3_8b_{devices}.py"
            path.write_text(ENTRY.format(shape=SHAPE, seq=SEQ, vocab=SHAPE["vocab_size"], batch=batch))
            graph = analyze(path).graph
            tokens = batch * SEQ
            fsdp = estimate_config(graph, Config(tp=1, dp=devices, zero=3, recompute=True), cluster, [], 96e9)
            auto = search_auto(graph, devices, cluster, [], 96e9)
            for label, e in (("FSDP as torchtitan runs it: dp, ZeRO-3, recompute", fsdp),
                             (f"--plan auto: {auto.config.describe()}", auto.best)):
                tps = tokens / e.seconds / devices
                rows.append((devices, label, e.seconds, e.memory, tps, tps * per_token / PEAK))
            print(devices, rows[-2:], flush=True)
    print(f"\nLlama 3.1 8B, {SEQ} tokens, local batch {LOCAL_BATCH}; {per_token / 1e9:.1f} GFLOP per token; "
          f"h100-node, bf16\n")
    print("| GPUs | configuration | est. step | est. memory per GPU | est. tokens/s/GPU | est. MFU | "
          "torchtitan tokens/s/GPU | torchtitan MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for devices, label, seconds, memory, tps, mfu in rows:
        published = PUBLISHED.get(devices)
        theirs = f"{published:,} | {published * per_token / PEAK:.0%}" if published and "FSDP" in label else "- | -"
        print(f"| {devices} | {label} | {seconds:.2f} s | {memory / 2**30:.1f} GiB | {tps:,.0f} | {mfu:.0%} | "
              f"{theirs} |")


if __name__ == "__main__":
    main()
