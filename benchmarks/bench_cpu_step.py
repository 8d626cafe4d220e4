"""The cost model against a measured training step on this CPU (issue 9, BENCH_PLANNING.md part 5).

    python benchmarks/bench_cpu_step.py [--steps 5]

Three models, none of them tuned for: the GPT fixture at a bigger config, and transformers'
Llama and BERT at small configs (their own code, from the installed package). For each:

- estimate: what `plan --dp 1` (cluster cpu-gloo, rules/devices/cpu-gloo.toml, which
  benchmarks/calibrate_cpu.py measures from single ops on this machine) prints as the step
  time: forward, backward and AdamW, priced op by op on the fake-tensor trace;
- measured: the model built by its entry file, one process with one intra-op thread (as a
  rank of the generated code runs), forward + loss + backward + torch.optim.AdamW's step,
  the median of `--steps` steps after two warm-up steps.

The spec is calibrated on single ops only; these step times were not used to fit anything.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPT_CONFIG = {"n_layer: int = 4": "n_layer: int = 6", "n_embd: int = 64": "n_embd: int = 512",
              "vocab_size: int = 128": "vocab_size: int = 8192", "randint(0, 128,": "randint(0, 8192,"}

LLAMA = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                                        max_position_embeddings=256, use_cache=False))


def example_inputs():
    ids = torch.randint(0, 8192, (8, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}
'''

BERT = '''
import torch
from transformers import BertConfig, BertForMaskedLM


def build():
    return BertForMaskedLM(BertConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048,
                                      num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=256,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def example_inputs():
    ids = torch.randint(0, 8192, (8, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}
'''


def model_files(folder: Path) -> list[tuple[str, Path]]:
    gpt = (ROOT / "fixtures" / "gpt.py").read_text()
    for old, new in GPT_CONFIG.items():
        if old not in gpt:
            raise SystemExit(f"fixtures/gpt.py has no `{old}`: update GPT_CONFIG")
        gpt = gpt.replace(old, new)
    files = []
    for name, text, label in (("cpu_gpt", gpt, "GPT fixture: 6 layers, n_embd 512, vocab 8192, batch 8 x 16 tokens"),
                              ("cpu_llama", LLAMA, "transformers Llama: 4 layers, hidden 512, seq 256, batch 8"),
                              ("cpu_bert", BERT, "transformers BERT (masked LM): 4 layers, hidden 512, seq 256, "
                                                 "batch 8")):
        path = folder / f"{name}.py"
        path.write_text(text.lstrip())
        files.append((label, path))
    return files


def estimate(path: Path) -> float:
    from nnscaler_cst.analysis import analyze
    from nnscaler_cst.rewrite import PlanRequest, build_plan
    analysis = analyze(path, trace_mode="fake")
    plan, _ = build_plan(analysis, PlanRequest(dp=1, cluster="cpu-gloo"))
    return plan.estimated_step_seconds


def measure(path: Path, steps: int) -> tuple[float, int]:
    """(median step seconds, parameters) of the model at `path`, one thread."""
    from nnscaler_cst.source.entry import load_entry
    from nnscaler_cst.source.files import SourceSet
    entry = load_entry(path, SourceSet())
    torch.manual_seed(0)
    model = entry.build()
    model.train()
    inputs = entry.example_inputs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        loss = entry.loss(entry.call_model(model, inputs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def rows(steps: int = 5) -> list[tuple[str, int, float, float]]:
    torch.set_num_threads(1)
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in model_files(Path(tmp)):
            measured, params = measure(path, steps)
            estimated = estimate(path)
            print(f"{label}: {params / 1e6:.1f} M parameters, estimate {estimated * 1e3:.0f} ms, "
                  f"measured {measured * 1e3:.0f} ms ({estimated / measured:.2f})", flush=True)
            found.append((label, params, estimated, measured))
    return found


def section(steps: int = 5) -> list[str]:
    lines = ["## 5. The cost model against a measured step on this CPU", "",
             "`python benchmarks/bench_cpu_step.py`: `plan --dp 1` on the cpu-gloo spec (measured on this machine "
             "by `python benchmarks/calibrate_cpu.py --write`, from single ops only) against forward + backward "
             f"+ AdamW measured in one process with one thread (median of {steps} steps after 2 warm-up steps).", "",
             "| model | parameters | estimate ms | measured ms | estimate / measured |", "|---|---:|---:|---:|---:|"]
    for label, params, estimated, measured in rows(steps):
        lines.append(f"| {label} | {params / 1e6:.1f} M | {estimated * 1e3:.0f} | {measured * 1e3:.0f} | "
                     f"{estimated / measured:.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    print("\n".join(section(parser.parse_args().steps)))


if __name__ == "__main__":
    main()
