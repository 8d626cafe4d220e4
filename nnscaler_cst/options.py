"""The plan options, declared once: each command's flags and help (cli.py), the fast check's
option table (__main__.py), the `[tool.nnscaler-rewrite]` keys (config.py) and the built-in
defaults. Adding an option is one row here (and its use in the pipeline).

Plain data: the fast `--check` path reads it before typer, rich or torch are imported.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple


class Option(NamedTuple):
    key: str                    # the options' dict key; pyproject's key with its underscores as dashes
    flags: tuple[str, ...]      # the command line's spellings, the long one first
    type: type                  # int, str, Path, or bool (a flag: no value)
    kind: str                   # what config.py checks a pyproject value is: size, name, bytes, ...
    default: Any                # under the pyproject table's value, under the command line's
    help: str
    scope: str                  # which commands have it: see SCOPES
    cost_only: bool = False     # read by the cost model alone: `verify` does not rewrite first for it


# scope -> the commands that take its options
SCOPES = {"plan": "rewrite, verify, plan, explain", "pipeline": "rewrite, verify, schedule",
          "output": "rewrite, verify", "model": "every command"}

# In the order the commands list them in --help.
OPTIONS = (
    Option("plan", ("--plan",), str, "name", None, "a table in rules/plans (dp, megatron, auto, ...); "
           "default: what --tp/--dp imply", "plan"),
    Option("tp", ("--tp",), int, "size", None, "tensor-parallel size", "plan"),
    Option("dp", ("--dp",), int, "size", None, "data-parallel size", "plan"),
    Option("devices", ("--devices",), int, "size", None, "devices for --plan auto", "plan"),
    Option("cluster", ("--cluster",), str, "name", "cpu-gloo",
           "device/cluster spec in rules/devices (default cpu-gloo)", "plan", cost_only=True),
    Option("precision", ("--precision",), str, "name", None, "compute dtype: fp32 | tf32 | bf16 | fp16; bf16 and "
           "fp16 write torch.autocast into the output (float32 master weights) and the cost model prices "
           "matmuls in it; default the traced tensors' dtype", "plan"),
    Option("memory_budget", ("--memory-budget",), str, "bytes", None, "memory per device the plan may use: "
           "bytes, or 24GiB, 80GB, 512MiB", "plan", cost_only=True),
    Option("pp", ("--pp",), int, "size", 1, "pipeline stages (ranks)", "pipeline"),
    Option("micro_batches", ("--micro-batches",), int, "size", None,
           "micro-batches per step (default: pp x virtual stages); with --pp 1, gradient "
           "accumulation over this many slices of each rank's batch (default 1)", "pipeline"),
    Option("schedule", ("--schedule",), str, "name", "1f1b",
           "gpipe | 1f1b | interleaved, or any schedule table in rules/plans", "pipeline"),
    Option("stages", ("--stages",), str, "stages", None, "block indices where stages 1.. begin, e.g. 6,12,18",
           "pipeline"),
    Option("recompute", ("--recompute",), bool, "flag", False, "run every repeated block under "
           "torch.utils.checkpoint: forward keeps its inputs only, backward reruns it", "plan"),
    Option("sequence_parallel", ("--sequence-parallel",), bool, "flag", False, "with --tp: Megatron's sequence "
           "parallelism (norms on sequence slices; reduce-scatter / all-gather)", "plan"),
    Option("zero", ("--zero",), int, "zero_stage", 0, "ZeRO stage over the data-parallel ranks: 1 shards "
           "optimizer state, 2 also gradients, 3 also parameters", "plan"),
    Option("out", ("--out", "-o"), Path, "name", "parallel", "output folder", "output"),
    Option("model", ("--model",), str, "name", None, "nn.Module class in the file to build when it has no build()",
           "model"),
)
BY_KEY = {option.key: option for option in OPTIONS}
DEFAULTS = {option.key: option.default for option in OPTIONS}

# The command line's options that take a value -> their keys (the fast check parses these).
VALUE_FLAGS = {flag: option.key for option in OPTIONS if option.type is not bool for flag in option.flags}
