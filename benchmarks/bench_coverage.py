#!/usr/bin/env python
"""Coverage of each library's architectures: does nnscaler-rewrite inspect, plan and verify them?

    python benchmarks/bench_coverage.py [--library transformers,timm,...|all] [--limit 64] [--only llama,bert]
                                        [--family vision,moe] [--jobs 1] [--timeout 300] [--work DIR]
                                        [--results FILE] [--out benchmarks/COVERAGE.md] [--dry-run]
    python benchmarks/bench_coverage.py --render [RESULTS_JSON ...] [--reclassify]
    python benchmarks/bench_coverage.py --merge /tmp/a.json [/tmp/b.json ...] [--library L] [--results FILE]
    python benchmarks/bench_coverage.py --entry path/to/model.py [--timeout 300] [--work DIR]
    python benchmarks/bench_coverage.py --list [--library timm] [--family moe]

Libraries (--library, default transformers): transformers, timm, torchvision, torchtitan, litgpt,
x-transformers, diffusers, torch.nn. Each is swept in turn into its own results file,
benchmarks/coverage_results.json for transformers (its historic name and format) and
benchmarks/coverage_results_<library>.json for the others; COVERAGE.md holds a section per
library that has one. How the other libraries' candidates are enumerated from their own
registries, and at which tiny settings: coverage_libraries.py. Installing them (not part of
the project's test install; the packages that depend on torch go in with --no-deps, so that pip
never replaces the CPU torch with a CUDA one, and the extra `bench` brings what they import):

    pip install -e ".[bench]" && pip install --no-deps timm x-transformers torch-einops-utils \
        torchtitan torch-checkpointing litgpt lightning torchmetrics && \
        pip install --no-deps --target /opt/bench-torchvision torchvision

torchvision goes into a folder of its own, never site-packages: where its wheel cannot load
(below), an installed torchvision breaks `from transformers import ...` for every user of the
environment. The bench puts that folder ($BENCH_TORCHVISION, default /opt/bench-torchvision)
on the path of timm's and torchvision's sweeps only.

On a CPU machine whose torchvision wheel is a CUDA build (its _C extension does not load, and
`import torchvision`, reached also through timm, lightning and diffusers, fails on
"operator torchvision::nms does not exist"), this process and the processes it starts for those
libraries first define the two op schemas torchvision's import needs (coverage_libraries.py,
TORCHVISION_SHIM), as a sitecustomize module in the work folder put first on the PYTHONPATH of
every process the bench starts: a rank process of verify imports the library in model.py before
any of the entry's code, so the entry file cannot carry it. The entries stay plain.

transformers' architectures come from transformers' own registries, not from a list typed here: every model
type of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES and MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
with its config class from CONFIG_MAPPING_NAMES. The family is decoder-only (causal LM),
encoder-only (masked LM), encoder-decoder (seq2seq LM) or vision (image classification), and
MoE whatever the task when the default config has more than one expert (num_experts,
num_local_experts, n_routed_experts, moe_num_experts). A model type reached by both a text
and another mapping counts once (seq2seq over masked over causal); aliases (a model type whose
config class belongs to another type) and composite configs (text_config + vision_config, ...)
are left out and listed as such.

Each config gets small overrides, only for the attributes it has (SIZES below: hidden 64, 2
layers, 4 heads, 2 kv heads, intermediate 128, vocab 128, 32x32 images in 8x8
patches, every dropout 0; special token ids beyond the vocabulary moved into it, and a
first_k_dense_replace that would leave 2 layers without experts set to 1); its defaults stay
otherwise, since users do not tune flags for a tool.

Per architecture, in a work folder outside the repository (--work, else a new temporary one
that is kept so raw outputs can be read):

1. an entry file ``hf_<type>.py`` with build() and example_inputs() (batch 4, seq 16,
   input_ids in [0, 128), labels; decoder_input_ids for encoder-decoders; pixel_values for
   vision), and loss(output) when the output carries no loss. Architectures alternate the
   entry style (``from transformers import X`` / ``import transformers; transformers.X``) and,
   among configs that have use_cache, the config default / ``use_cache=False``;
2. a plain PyTorch check in a subprocess: build, one forward + backward on CPU. An
   architecture that fails it (or has over 100M parameters at this config) is "skipped: does
   not run at this config", with the reason; that is not a failure of the tool. One that
   fails only with 2 kv heads (multi-head latent attention: DeepSeek-V3, MiniCPM3) is tried
   again with as many kv heads as heads, and noted;
3. each as a subprocess with a timeout: ``nnscaler-rewrite inspect ENTRY --json`` (share of
   call sites annotated), ``plan ENTRY --tp 2 --json`` (wall seconds), then ``verify --json``
   at TP=2, DP=2, PP=2 (``--pp 2 --micro-batches 2``) and DP x TP (``--dp 2 --tp 2``), each
   into its own ``-o`` folder. The TP=2 folder's plan.json gives the share of block parameters
   (those under a repeated layer, from inspect's block containers; every parameter of a model
   without repeated layers) that the TP plan splits, counted in elements.

Each run is classified: pass (shown "pass (float64)" where float32 failed by rounding and
verify's float64 second opinion passed); refused (exit 2 with an ``error:`` line, nothing written);
wrong (verify exit 1, its JSON says the results differ); crash (a rank or the tool raised:
exit 1 with a traceback, or any other exit); timeout (killed at --timeout, or verify's own
"timed out ... waiting for rank(s)": verify gets --timeout 0.4 x the limit, per group of
processes, so that a hang is reported by verify with the ranks involved).

Results: one JSON record per architecture x run (--results), written after every
architecture, and COVERAGE.md rendered from it (--render re-renders without rerunning).
--merge folds the results of other sweeps (each run with its own --results file) into
--results: an architecture's records from a later file replace earlier ones, and COVERAGE.md
names each sweep's command and revision and the architectures whose records it holds.
--limit N stops after N architectures that pass the plain check (per library), taken
round-robin over the families in a fixed order; --limit 0 takes all. Not part of CI.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, load_file, revision  # noqa: E402
from coverage_libraries import LIBRARIES, LibraryArch, library_archs, library_version, mean_square, results_name  # noqa: E402

FAMILIES = ("decoder", "encoder", "encoder-decoder", "vision", "moe")
KIND_FAMILY = {"causal": "decoder", "masked": "encoder", "seq2seq": "encoder-decoder", "image": "vision"}
# Which registry wins when a model type is in several (bart is in all three text ones).
KIND_PRIORITY = ("seq2seq", "masked", "causal", "image")
MAPPINGS = {"causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
            "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "image": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}
MOE_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

VOCAB, BATCH, SEQ = 128, 4, 16
# Override value -> config attributes it applies to (only those the config has, with an int,
# float or None value: a list such as Swin's num_heads stays the default).
SIZES = {
    64: ("hidden_size", "d_model", "n_embd", "embed_dim", "emb_dim", "dim", "embedding_size"),
    2: ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
        "num_encoder_layers", "num_decoder_layers"),
    4: ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
        "decoder_attention_heads"),
    128: ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "hidden_dim",
          "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size",
          "vocab_size", "decoder_vocab_size", "src_vocab_size", "tgt_vocab_size"),
}
KV_HEADS = ("num_key_value_heads", "num_kv_heads")      # 2
IMAGE = {"image_size": 32, "patch_size": 8, "num_channels": 3}
DROPOUT = re.compile(r"dropout|pdrop|drop_path|layerdrop|drop_rate")
MAX_PARAMS = 100e6

RUNS = {  # run name -> nnscaler-rewrite arguments after the entry file
    "inspect": ["--json"],
    "plan": ["--tp", "2", "--json"],
    "tp2": ["--tp", "2", "--json"],
    "dp2": ["--dp", "2", "--json"],
    "pp2": ["--pp", "2", "--micro-batches", "2", "--json"],
    "dp2xtp2": ["--dp", "2", "--tp", "2", "--json"],
}
VERIFY_RUNS = ("tp2", "dp2", "pp2", "dp2xtp2")
MODE_TITLES = {"inspect": "inspect", "plan": "plan TP=2", "tp2": "TP=2", "dp2": "DP=2", "pp2": "PP=2",
               "dp2xtp2": "DP×TP 2×2"}
SPLIT_TARGET = 0.75
DEFAULT_OUT = ROOT / "benchmarks" / "COVERAGE.md"


# --------------------------------------------------------------------------- architectures

@dataclass
class Arch:
    name: str                  # the model type
    family: str
    kind: str                  # causal | masked | seq2seq | image: which inputs it takes
    model_class: str
    config_class: str
    style: str = "from"        # "from": from transformers import X; "module": transformers.X
    use_cache: str = "-"       # "default" | "off" | "-" (the config has no use_cache)
    overrides: dict = field(default_factory=dict)
    has_cache: bool = False


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


def config_value(config, name: str, default=None):
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 - a per-layer attribute that refuses global reads: its stored value
        return vars(config).get(name, default)


def config_overrides(config) -> dict:
    """The small-size overrides for the attributes this config has (aliases left out)."""
    aliases = set(getattr(type(config), "attribute_map", {}) or {})
    missing = object()

    def get(name):
        return config_value(config, name, missing)

    def has(name):   # a stored number (not an alias, not a property derived from others)
        value = get(name)
        return name not in aliases and not isinstance(getattr(type(config), name, None), property) and \
            value is not missing and (value is None or type(value) in (int, float))

    out = {}
    for value, names in SIZES.items():
        out.update({n: value for n in names if has(n)})
    out.update({n: 2 for n in KV_HEADS if has(n)})
    out.update({n: v for n, v in IMAGE.items() if has(n)})
    for name in sorted(vars(config)):
        value = get(name)
        if DROPOUT.search(name) and type(value) is float and value > 0 and name not in aliases:
            out[name] = 0.0
        elif DROPOUT.search(name) and type(value) in (list, tuple) and name not in aliases and \
                any(type(v) is float and v > 0 for v in value):     # per stage (CvT's drop_path_rate)
            out[name] = [0.0 if type(v) is float else v for v in value]
    vocab = out.get("vocab_size", VOCAB)
    for new, name in enumerate(("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
                                "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")):
        value = get(name) if name not in aliases else None
        if type(value) is int and value >= vocab:
            out[name] = new
    layers = out.get("num_hidden_layers", out.get("num_layers", 2))
    if type(get("first_k_dense_replace")) is int and get("first_k_dense_replace") >= layers:
        out["first_k_dense_replace"] = 1
    return out


def enumerate_archs() -> tuple[list[Arch], list[dict]]:
    """Every candidate architecture in a fixed order (round-robin over FAMILIES, model types
    sorted within each), and the model types left out with why."""
    transformers = _quiet_transformers()
    from transformers.models.auto import configuration_auto, modeling_auto
    config_names = configuration_auto.CONFIG_MAPPING_NAMES
    chosen: dict[str, tuple[str, str]] = {}
    for kind in reversed(KIND_PRIORITY):                 # later (higher-priority) kinds overwrite
        for model_type, cls in getattr(modeling_auto, MAPPINGS[kind]).items():
            chosen[model_type] = (kind, cls[0] if isinstance(cls, (tuple, list)) else cls)
    by_family: dict[str, list[Arch]] = {f: [] for f in FAMILIES}
    left_out, seen_classes = [], set()
    for model_type in sorted(chosen):
        kind, cls_name = chosen[model_type]
        config_name = config_names.get(model_type)
        try:        # a lazily exported class whose own requirements are missing raises, not None
            config_cls, model_cls = getattr(transformers, config_name or "-", None), getattr(transformers, cls_name, None)
        except Exception as exc:     # noqa: BLE001 - any import failure leaves the type out
            left_out.append({"name": model_type, "reason": f"{cls_name} does not import: {type(exc).__name__}"})
            continue
        if config_cls is None or model_cls is None:
            left_out.append({"name": model_type, "reason": f"{config_name or 'config'} / {cls_name} not exported "
                             "by transformers"})
            continue
        owner = getattr(getattr(model_cls, "config_class", None), "model_type", model_type)
        if getattr(config_cls, "model_type", model_type) != model_type or owner != model_type:
            left_out.append({"name": model_type, "reason": f"{cls_name} belongs to {owner}"})
            continue
        if getattr(config_cls, "sub_configs", None):
            left_out.append({"name": model_type, "reason": "composite config (" + ", ".join(config_cls.sub_configs)
                             + ")"})
            continue
        if cls_name in seen_classes:
            left_out.append({"name": model_type, "reason": f"{cls_name} already covered"})
            continue
        seen_classes.add(cls_name)
        try:
            config = config_cls()
        except Exception as exc:  # noqa: BLE001 - a config that cannot be built is listed, not fatal
            left_out.append({"name": model_type, "reason": f"{config_name}() raised {type(exc).__name__}"})
            continue
        moe = any(type(value) is int and value > 1 for value in (config_value(config, a) for a in MOE_ATTRS))
        family = "moe" if moe else KIND_FAMILY[kind]
        by_family[family].append(Arch(model_type, family, kind, cls_name, config_name,
                                      overrides=config_overrides(config),
                                      has_cache=config_value(config, "use_cache", KeyError) is not KeyError))
    ordered: list[Arch] = []
    queues = [list(v) for v in by_family.values()]
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    cache_count = 0
    for i, arch in enumerate(ordered):
        arch.style = "from" if i % 2 == 0 else "module"
        if arch.has_cache:
            arch.use_cache = "default" if cache_count % 2 == 0 else "off"
            cache_count += 1
    return ordered, left_out


def entry_source(arch: Arch, with_loss: bool = False) -> str:
    """The entry file for one architecture."""
    kwargs = dict(arch.overrides)
    if arch.use_cache == "off":
        kwargs["use_cache"] = False
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if arch.style == "from":
        header = f"from transformers import {arch.config_class}, {arch.model_class}"
        config_call, model_call = arch.config_class, arch.model_class
    else:
        header = "import transformers"
        config_call, model_call = f"transformers.{arch.config_class}", f"transformers.{arch.model_class}"
    if arch.kind == "image":
        inputs = ["pixel_values = torch.randn({b}, {c}, {s}, {s})".format(
                      b=BATCH, c=arch.overrides.get("num_channels", 3), s=arch.overrides.get("image_size", 32)),
                  f"labels = torch.randint(0, 2, ({BATCH},))",
                  'return {"pixel_values": pixel_values, "labels": labels}']
    elif arch.kind == "seq2seq":
        inputs = [f"input_ids = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}))",
                  f"decoder_input_ids = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}))",
                  f"labels = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}))",
                  'return {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "labels": labels}']
    else:
        inputs = [f"input_ids = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}))",
                  'return {"input_ids": input_ids, "labels": input_ids}']
    body = "\n".join("    " + line for line in inputs)
    text = (f'"""Entry file written by benchmarks/bench_coverage.py: transformers\' {arch.model_class} '
            f'({arch.name}, {arch.family}) at a tiny config."""\n'
            f"import torch\n{header}\n\n\n"
            f"def build():\n    config = {config_call}({args})\n    return {model_call}(config)\n\n\n"
            f"def example_inputs():\n{body}\n")
    if with_loss:
        text += ("\n\ndef loss(output):\n    # the output carries no loss: the mean square of its first tensor\n"
                 f"    return {mean_square('output[0]')}\n")
    return text


# --------------------------------------------------------------------------- plain check

def check_entry(path: Path) -> dict:
    """In this process: build the entry's model and run one forward + backward in plain
    PyTorch. Returns {"ok", "reason", "params", "has_loss", "experts", "seconds"}."""
    if "transformers" in path.read_text():
        _quiet_transformers()
    import torch
    started = time.perf_counter()
    entry = load_file(path, "coverage_entry")
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in entry.build().parameters())
    except Exception:  # noqa: BLE001 - some models cannot be built on meta; build for real below
        params = None
    if params is not None and params > MAX_PARAMS:
        return {"ok": False, "reason": f"too large at this config: {params / 1e6:.0f}M parameters", "params": params}
    try:
        torch.manual_seed(0)
        model = entry.build()
        model.train()
        params = sum(p.numel() for p in model.parameters())
        inputs = entry.example_inputs()
        output = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        if hasattr(entry, "loss"):
            value = entry.loss(output)
        elif isinstance(output, torch.Tensor) and output.dim() == 0:
            value = output
        else:
            value = getattr(output, "loss", None)
        has_loss = isinstance(value, torch.Tensor) and value.dim() == 0
        if not has_loss:
            value = output[0].float().pow(2).mean()
        value.backward()
        if not torch.isfinite(value):
            raise FloatingPointError(f"loss is {value.item()}")
    except Exception as exc:  # noqa: BLE001 - any failure means: does not run at this config
        return {"ok": False, "reason": one_line(f"{type(exc).__name__}: {exc}"), "params": params}
    experts = sum(1 for name, _ in model.named_modules() if re.search(r"(^|\.)experts$", name))
    return {"ok": True, "reason": "", "params": params, "has_loss": has_loss, "experts": experts,
            "seconds": round(time.perf_counter() - started, 2)}


def one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.strip().split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


# --------------------------------------------------------------------------- running the tool

def cli() -> list[str]:
    exe = shutil.which("nnscaler-rewrite")
    return [exe] if exe else [sys.executable, "-m", "nnscaler_cst.cli"]


PYTHONPATH_FIRST: list[str] = []   # folders put first on the started processes' PYTHONPATH (coverage_libraries.shim_site)
LIVE: set[int] = set()   # process groups started and not yet finished: killed if the bench is stopped
STOPPING = threading.Event()


def kill_live() -> None:
    STOPPING.set()
    for pid in list(LIVE):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_process(argv: list[str], cwd: Path, timeout: float, log: Path) -> tuple[int | None, str, str, float]:
    """Run argv in its own process group; kill the group at the timeout. Returns (exit code or
    None on timeout, stdout, stderr, wall seconds); both outputs are also kept in log.*."""
    # COLUMNS: rich, which prints the tool's messages, wraps at 80 columns when not on a terminal.
    if STOPPING.is_set():
        raise RuntimeError("the bench is stopping")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", COLUMNS="100000")
    if PYTHONPATH_FIRST:
        env["PYTHONPATH"] = os.pathsep.join(PYTHONPATH_FIRST + [p for p in [env.get("PYTHONPATH")] if p])
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    LIVE.add(proc.pid)
    try:
        if STOPPING.is_set():
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    finally:
        LIVE.discard(proc.pid)
    seconds = time.perf_counter() - started
    log.with_suffix(".stdout").write_text(out or "")
    log.with_suffix(".stderr").write_text(err or "")
    return code, out or "", err or "", seconds


ERROR_LINE = re.compile(r"(^|: )error: ")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit|Failure)\b.*")
FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def exception_reason(text: str) -> str:
    """The last exception line of a traceback, with the frame that raised it."""
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", l) for l in text.splitlines()]   # torch.distributed's prefix
    where = ""
    for i in range(len(lines) - 1, -1, -1):
        if EXCEPTION_LINE.match(lines[i].strip()):
            frames = [FRAME_LINE.match(l) for l in lines[:i]]
            frames = [m for m in frames if m]
            if frames:
                where = f" (at {Path(frames[-1].group(1)).name}:{frames[-1].group(2)} in {frames[-1].group(3)})"
            return one_line(lines[i].strip()) + where
    tail = [l for l in lines if l.strip()]
    return one_line(tail[-1]) if tail else "no output"


def parse_json(text: str):
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except json.JSONDecodeError:
        return None


def classify(run: str, code: int | None, out: str, err: str, out_dir: Path | None) -> tuple[str, str, dict]:
    """(status, one-line reason, details) of one run."""
    if code is None:
        written = out_dir is not None and out_dir.exists()
        return "timeout", "killed at the time limit " + ("after the output was written" if written else
                                                          "before any output was written"), {}
    if code == 0:
        data = parse_json(out)
        if data is None:
            return "crash", "exit 0 without JSON output", {}
        if run in VERIFY_RUNS:
            details = {k: data.get(k) for k in ("max_abs_error", "max_grad_error", "seconds")}
            if data.get("passed"):
                if data.get("float64"):     # float32 failed by rounding, float64 passed: the table says so
                    details["float64"] = {k: data["float64"].get(k) for k in ("max_abs_error", "max_grad_error")}
                return "pass", "", details
            return "wrong", "exit 0 but passed is false", details
        return "ok", "", {"json": data}
    if code == 2:
        lines = [l for l in err.splitlines() if ERROR_LINE.search(l)]
        if lines:
            written = out_dir is not None and out_dir.exists()
            return "refused", one_line(lines[0]), {"written": written} if written else {}
        return "crash", "exit 2 without an error: line: " + exception_reason(err), {}
    if run in VERIFY_RUNS and code == 1:
        data = parse_json(out)
        if data is not None and data.get("passed") is False:
            tol = data["tolerance"]
            losses = max(data.get("loss_errors") or [0.0])
            beyond = [what for what, bad in (
                ("losses", any(e > tol["loss_atol"] + tol["rtol"] * abs(r)
                               for e, r in zip(data["loss_errors"], data["reference_losses"]))),
                ("parameters", data["max_abs_error"] > tol["param_atol"]),
                ("first-step gradients", data["max_grad_error"] > tol["grad_rtol"]),
                ("first-step buffers", data.get("max_buffer_error", 0.0) > tol["grad_rtol"])) if bad]
            reason = (f"{' and '.join(beyond) or 'results'} beyond tolerance: max loss error {losses:.2e}, "
                      f"max param error {data['max_abs_error']:.2e} ({data['worst_param']}), "
                      f"max grad error {data['max_grad_error']:.2e} ({data['worst_grad']})" +
                      (f", max buffer error {data['max_buffer_error']:.2e} ({data['worst_buffer']})"
                       if data.get("max_buffer_error", 0.0) > tol["grad_rtol"] else ""))
            return "wrong", reason, {k: data.get(k) for k in ("max_abs_error", "max_grad_error", "worst_param",
                                                               "worst_grad", "loss_errors")}
        failed = [l for l in err.splitlines() if l.startswith("verify failed: ")]
        if failed and "timed out after" in failed[0]:
            after = err.split(failed[0], 1)[1].splitlines()      # "  rank 0 is in FRAME" lines
            return "timeout", one_line("; ".join([failed[0]] + [l.strip() for l in after if l.startswith("  rank ")]),
                                       limit=600), {}
        if failed:
            head = re.match(r"verify failed: (process \S+ exited with -?\d+)", failed[0])
            prefix = f"{head.group(1)}: " if head else ""
            # the traceback after the line, else the line itself (an error verify found in the results)
            return "crash", prefix + exception_reason(err.split(failed[0], 1)[1].strip() or failed[0]), {}
    return "crash", f"exit {code}: " + exception_reason(err), {}


def block_patterns(blocks: dict | None) -> list[re.Pattern]:
    """Parameter-name patterns of the repeated layers inspect found ("GPT2Block (transformer.h.*)");
    none when it found none. A numbered path is no block then: the `0` of DLA's `level0.0.weight`
    is an nn.Sequential's conv, so the share is over every parameter (split_share)."""
    patterns = []
    for key in blocks or {}:
        match = re.search(r"\((.*)\.\*\)$", key)
        if match:
            patterns.append(re.compile(re.escape(match.group(1)) + r"\.\d+\."))
    return patterns


def split_share(plan_json: Path, patterns: list[re.Pattern]) -> dict | None:
    """Share of the block parameters the TP plan splits, in elements and in count; with no
    patterns (no repeated layers), of every parameter."""
    if not plan_json.is_file():
        return None
    params = json.loads(plan_json.read_text()).get("params", {})
    total = split = count = split_count = 0
    for name, info in params.items():
        if patterns and not any(p.search(name) for p in patterns):
            continue
        numel = 1
        for size in info.get("shape", []):
            numel *= size
        is_split = str(info.get("tp", "R")).startswith("S")
        total, count = total + numel, count + 1
        split, split_count = split + numel * is_split, split_count + is_split
    if not count:
        return {"share": None, "block_params": 0}
    return {"share": round(split / total, 4) if total else 0.0, "count_share": round(split_count / count, 4),
            "block_params": count, "block_elements": total}


def run_entry(entry: Path, work: Path, timeout: float, arch: str) -> list[dict]:
    """The per-architecture runner: inspect, plan, and the four verifies of one entry file.
    Raw outputs stay in work/<run>.stdout and .stderr, verify's outputs in work/out_<run>."""
    work.mkdir(parents=True, exist_ok=True)
    records = []
    for run, extra in RUNS.items():
        command = "inspect" if run == "inspect" else "plan" if run == "plan" else "verify"
        argv = cli() + [command, str(entry), *extra]
        if run in VERIFY_RUNS:
            shutil.rmtree(work / f"out_{run}", ignore_errors=True)
            # verify's own limit (per group of processes) fires first and names the ranks that hung.
            argv += ["-o", str(work / f"out_{run}"), "--timeout", str(max(30, int(timeout * 0.4)))]
        code, out, err, seconds = run_process(argv, work, timeout, work / run)
        record = {"arch": arch, "run": run, "seconds": round(seconds, 2), "exit_code": code,
                  "command": shlex.join(["nnscaler-rewrite", *argv[len(cli()):]]), "work": str(work)}
        records.append(assess(record, out, err, records))
    return records


def assess(record: dict, out: str, err: str, earlier: list[dict]) -> dict:
    """Fill in status, reason and details of one run from its exit code and outputs (the
    inspect run of the same architecture, in earlier, gives the repeated layers)."""
    run, work = record["run"], Path(record["work"])
    out_dir = work / f"out_{run}" if run in VERIFY_RUNS else None
    status, reason, details = classify(run, record["exit_code"], out, err, out_dir)
    data = details.pop("json", None)
    if run == "inspect" and data:
        sites, summary = data["sites"], data["summary"]
        details = {"annotated_sites": round(sum(s["annotation"] is not None for s in sites) / max(len(sites), 1), 4),
                   "annotated_ops": round(summary["annotated"] / max(summary["compute_ops"], 1), 4),
                   "sites": len(sites), "blocks": data.get("blocks", {})}
    if run == "plan" and data:
        ops = data.get("ops", [])
        details = {"split_sites": sum(o["tp"] != "replicate" for o in ops), "sites": len(ops)}
    if run == "tp2":
        blocks = next((r["details"].get("blocks") for r in earlier if r["run"] == "inspect"), None)
        details["split"] = split_share(out_dir / "plan.json", block_patterns(blocks))
    return {**record, "status": status, "reason": reason, "details": details}


def reclassify(data: dict) -> None:
    """Classify every run again from the raw outputs kept in the work folder (after a change
    to classify(), without rerunning anything)."""
    for arch in data["architectures"]:
        records = []
        for record in arch["records"]:
            log = Path(record["work"]) / record["run"]
            records.append(assess(record, log.with_suffix(".stdout").read_text(),
                                  log.with_suffix(".stderr").read_text(), records))
        arch["records"] = records


# --------------------------------------------------------------------------- the sweep

def prepare(arch: Arch, work: Path, timeout: float) -> tuple[Path, dict]:
    """Write the entry file and run the plain check. The entry gets a loss() when the output
    carries none; a model that fails with 2 kv heads (multi-head latent attention ties them to
    the heads) is tried again with as many kv heads as heads (arch.overrides says which ran).
    Returns (entry path, check result). Another library's candidate: its variants in turn."""
    if isinstance(arch, LibraryArch):
        return prepare_library(arch, work, timeout)
    folder = work / arch.name.replace("-", "_")
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / f"hf_{arch.name.replace('-', '_')}.py"
    kv = {k: 4 for k in KV_HEADS if k in arch.overrides}
    first = None
    for overrides in [arch.overrides] + ([{**arch.overrides, **kv}] if kv else []):
        arch.overrides = overrides
        result = check_variant(arch, entry, timeout)
        if result["ok"]:
            if first is not None:
                result["note"] = f"kv heads = heads: with 2 kv heads, {first['reason']}"
            return entry, result
        first = first or result
    return entry, first


def prepare_library(arch: LibraryArch, work: Path, timeout: float) -> tuple[Path, dict]:
    """The candidate's entry variants, in order, until one runs in plain PyTorch; the check
    result notes which variant ran when it is not the first."""
    slug = re.sub(r"\W+", "_", f"{arch.library}_{arch.name}")
    folder = work / slug
    folder.mkdir(parents=True, exist_ok=True)
    entry = folder / f"{slug}.py"
    try:
        variants = arch.variants()
    except Exception as exc:  # noqa: BLE001 - a registry entry that cannot even be configured
        return entry, {"ok": False, "reason": one_line(f"entry not written: {type(exc).__name__}: {exc}")}
    first = None
    for k, (note, text) in enumerate(variants):
        arch.overrides = {"variant": note}
        result = check_variant(arch, entry, timeout, text)
        if result["ok"]:
            if k:
                result["note"] = f"{note} (the tiny variant fails in plain PyTorch: {first['reason']})"
            return entry, result
        first = first or result
        if k:
            first["reason"] += f"; {note}: {result['reason']}"
    return entry, first


def check_variant(arch, entry: Path, timeout: float, text: str | None = None) -> dict:
    entry.write_text(text if text is not None else entry_source(arch))
    argv = [sys.executable, str(Path(__file__).resolve()), "--check-entry", str(entry)]
    while True:
        code, out, err, seconds = run_process(argv, entry.parent, timeout, entry.parent / "check")
        if code is None:
            return {"ok": False, "reason": f"plain forward + backward took over {timeout:.0f}s"}
        result = parse_json(out) if code == 0 else None
        if result is None:
            return {"ok": False, "reason": f"plain check exited {code}: " + exception_reason(err)}
        if result["ok"] and not result["has_loss"] and "def loss(" not in entry.read_text():
            entry.write_text(entry_source(arch, with_loss=True))
            continue
        result["wall_seconds"] = round(seconds, 2)
        return result


def sweep_one(arch: Arch, work: Path, timeout: float, check_timeout: float, dry_run: bool) -> dict:
    started, source = time.perf_counter(), source_state()
    try:
        entry, check = prepare(arch, work, check_timeout)
    except (OSError, ValueError, KeyError) as exc:    # a bug here should not end a sweep of hours
        entry, check = work / arch.name, {"ok": False, "reason": f"bench error: {type(exc).__name__}: {exc}"}
    base = {"arch": arch.name, "family": arch.family, "model_class": arch.model_class,
            "config_class": arch.config_class, "style": arch.style, "use_cache": arch.use_cache,
            "overrides": arch.overrides, "entry": str(entry), "check": check, "source": source,
            "with_loss": entry.is_file() and "def loss(" in entry.read_text()}
    records = []
    if check["ok"] and not dry_run:
        records = run_entry(entry, entry.parent, timeout, arch.name)
    return {**base, "records": records, "seconds": round(time.perf_counter() - started, 2)}


def source_state() -> str:
    """HEAD, plus a short hash of the uncommitted changes to nnscaler_cst/ and rules/ (diff and
    untracked files) when there are any: the tool may change while a sweep of hours runs."""
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout
    diff = git("diff", "HEAD", "--", "nnscaler_cst", "rules")
    untracked = sorted(git("ls-files", "--others", "--exclude-standard", "--", "nnscaler_cst", "rules").split())
    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    if not diff and not untracked:
        return head
    digest = hashlib.sha1(diff.encode())
    for name in untracked:
        digest.update(name.encode() + (ROOT / name).read_bytes())
    return f"{head}+{digest.hexdigest()[:8]}"


def save(results_path: Path, meta: dict, archs: list[dict], left_out: list[dict]) -> None:
    results_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = results_path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**meta, "architectures": archs, "left_out": left_out}, indent=1))
    tmp.replace(results_path)


def sweep(args, library: str = "transformers") -> dict:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="nnscaler-coverage-"))
    if library != "transformers" and len(args.libraries) > 1:
        work = work / library
    work.mkdir(parents=True, exist_ok=True)
    if library == "transformers":
        archs, left_out = enumerate_archs()
    else:
        archs, left_out, first = library_archs(library, work)
        # the torchvision workaround and folder, for every process started from here on
        PYTHONPATH_FIRST[:] = [str(folder) for folder in first]
    if args.family:
        families = set(args.family.split(","))
        known_families = FAMILIES if library == "transformers" else sorted({a.family for a in archs})
        unknown = families - set(known_families)
        if unknown:
            raise SystemExit(f"unknown family {', '.join(sorted(unknown))}; families: {', '.join(known_families)}")
        archs = [a for a in archs if a.family in families]
    if args.only:
        names = args.only.split(",")
        known = {a.name for a in archs}
        missing = [n for n in names if n not in known]
        if missing:
            raise SystemExit(f"not a candidate: {', '.join(missing)} (see --list)")
        archs = [a for a in archs if a.name in names]
    if args.list:
        for i, a in enumerate(archs):
            print(f"{i:4d} {a.name:28s} {a.family:16s} {a.model_class:44s} {a.style:6s} use_cache={a.use_cache}")
        print(f"{len(archs)} candidates of {library}; left out: "
              + "; ".join(f"{d['name']} ({d['reason']})" for d in left_out))
        return {}
    import torch
    meta = {"library": library, "command": shlex.join(["python", "benchmarks/bench_coverage.py", *sys.argv[1:]]),
            "revision": revision(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "versions": f"Python {platform.python_version()}, torch {torch.__version__}, "
                        f"{library_version(library)}, "
                        f"{os.cpu_count()} CPU cores",
            "timeout": args.timeout, "jobs": args.jobs, "limit": args.limit, "work": str(work),
            "dry_run": args.dry_run}
    if library == "transformers":       # the format of the records kept in coverage_results.json
        meta.pop("library")
    print(f"work folder: {work}", flush=True)
    results = results_path(args, library)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_sweep(archs, args, work, lambda done: save(results, meta, done, left_out))
    return json.loads(results.read_text())


def results_path(args, library: str) -> Path:
    """--results, else the library's file in benchmarks/ (in the work folder for a dry run)."""
    if args.results:
        return Path(args.results)
    if args.dry_run:
        return Path(args.work) / results_name(library)
    return ROOT / "benchmarks" / results_name(library)


def run_sweep(archs: list[Arch], args, work: Path, save_done) -> None:
    """Run the architectures, --jobs at a time, in order. Submitting stops while the ones that
    passed the plain check plus those in flight reach --limit, so the result is the first
    --limit architectures that run, whatever --jobs is. save_done(results) after each one."""
    done: dict[int, dict] = {}
    running = 0                                  # architectures that passed the plain check
    pending = list(enumerate(archs))
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        in_flight: dict[concurrent.futures.Future, int] = {}
        try:
            while pending or in_flight:
                while pending and len(in_flight) < args.jobs and \
                        (not args.limit or running + len(in_flight) < args.limit):
                    i, arch = pending.pop(0)
                    in_flight[pool.submit(sweep_one, arch, work, args.timeout, args.check_timeout, args.dry_run)] = i
                if not in_flight:
                    break
                finished, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    i = in_flight.pop(future)
                    done[i] = future.result()
                    running += done[i]["check"]["ok"]
                    print(progress_line(done[i], time.perf_counter() - started), flush=True)
                save_done([done[k] for k in sorted(done)])
        except BaseException:       # Ctrl-C, SIGTERM: end the processes this bench started, then stop
            kill_live()
            raise


def progress_line(result: dict, elapsed: float) -> str:
    if not result["check"]["ok"]:
        return f"[{elapsed:6.0f}s] {result['arch']}: skipped ({result['check']['reason']})"
    runs = " ".join(f"{r['run']}={r['status']}" for r in result["records"]) or "runs in plain PyTorch"
    return f"[{elapsed:6.0f}s] {result['arch']} ({result['family']}, {result['seconds']:.0f}s): {runs}"


# --------------------------------------------------------------------------- COVERAGE.md

def normalise(text: str) -> str:
    """A reason with paths, positions, names with numbers and numbers stripped, to group by."""
    text = re.sub(r"^\S+:\d+:\d+: ", "", text)                       # path:line:col: of an error line
    text = re.sub(r"\(at [^)]*\)", "", text)                         # (at file.py:12 in f)
    text = re.sub(r"(/[\w.+-]+)+/?", "<path>", text)
    text = re.sub(r"\b[\w.]*\d[\w.]*\b", "N", text)                  # numbers and names holding them
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", text)        # quoted names
    text = re.sub(r"\([^()]*\bN\b[^()]*\)", "(…)", text)             # shapes and tuples of numbers
    return " ".join(text.split())


def group_key(record: dict) -> str:
    """What failures are grouped by: which tolerances a wrong result broke, whether a timeout
    was a hang verify saw, else the normalised reason."""
    reason = record["reason"]
    if record["status"] == "wrong":
        reason = reason.split(":")[0]
    elif record["status"] == "timeout":
        reason = reason.split("; rank ")[0]
    return f"{record['status']}: {normalise(reason)}"


def split_of(runs: dict) -> float | None:
    """The share of block parameter elements the TP=2 plan split, or None when unknown."""
    return (runs.get("tp2", {}).get("details", {}).get("split") or {}).get("share")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render(data: dict) -> str:
    archs = data["architectures"]
    ran = [a for a in archs if a["check"]["ok"]]
    skipped = [a for a in archs if not a["check"]["ok"]]
    by_run = {a["arch"]: {r["run"]: r for r in a["records"]} for a in ran}
    n = len(ran)
    library = data.get("library", "transformers")
    hf = library == "transformers"
    intro = ("Architectures come from transformers' auto-model registries, each at a tiny config (hidden 64, 2 "
             "layers, 4 heads, 2 kv heads, intermediate 128, vocab 128, 32×32 images, no dropout; the config's "
             "defaults otherwise)" if hf else LIBRARY_INTROS[library])
    lines = [f"# {title_of(library)}",
             "",
             "Written by `benchmarks/bench_coverage.py` (its docstring says how architectures are chosen and runs "
             f"classified). {intro}; per architecture `nnscaler-rewrite inspect`, `plan --tp 2` and "
             "`verify` at TP=2, DP=2, PP=2 (2 micro-batches) and DP×TP 2×2.",
             "",
             *run_lines(data),
             f"- timeout {data['timeout']:.0f} s per run, {data['jobs']} job(s) in parallel; "
             f"{len(archs)} architectures tried, {n} run in plain PyTorch at this config, {len(skipped)} skipped",
             f"- re-render without rerunning: `python benchmarks/bench_coverage.py --render {data.get('results', 'RESULTS.json')}`",
             ""]
    if data.get("dry_run"):
        lines += ["Dry run: entries written and checked in plain PyTorch only.", ""]
    # Summary.
    lines += ["## Summary", "",
              "| run | pass | refused | wrong | crash | timeout | pass rate |", "|---|---:|---:|---:|---:|---:|---:|"]
    for run in RUNS:
        statuses = [by_run[a["arch"]].get(run, {}).get("status") for a in ran]
        good = sum(s in ("pass", "ok") for s in statuses)
        counts = [good] + [sum(s == k for s in statuses) for k in ("refused", "wrong", "crash", "timeout")]
        lines.append(f"| {MODE_TITLES[run]} | " + " | ".join(map(str, counts)) + f" | {pct(good / n if n else None)} |")
    shares = {a["arch"]: split_of(by_run[a["arch"]]) for a in ran}
    split_ok = sum(1 for s in shares.values() if s is not None and s >= SPLIT_TARGET)
    tp_and_split = sum(1 for a in ran if by_run[a["arch"]].get("tp2", {}).get("status") == "pass"
                       and (shares[a["arch"]] or 0) >= SPLIT_TARGET)
    planned = [a for a in ran if by_run[a["arch"]].get("plan", {}).get("status") == "ok"]
    plan_seconds = [by_run[a["arch"]]["plan"]["seconds"] for a in planned]
    beyond = [by_run[a["arch"]]["plan"]["seconds"] - a["check"]["wall_seconds"] for a in planned]
    lines += ["",
              f"- TP=2 plans splitting ≥ {SPLIT_TARGET:.0%} of block parameters (elements of the parameters under "
              f"repeated layers, of every parameter where there are none, read from the TP=2 output's plan.json): {split_ok} of {n} ({pct(split_ok / n if n else None)}); "
              f"TP=2 passing *and* splitting ≥ {SPLIT_TARGET:.0%}: {tp_and_split} of {n} ({pct(tp_and_split / n if n else None)})",
              "- `plan --tp 2` wall seconds (whole process: start-up, tracing, search): " +
              (f"median {statistics.median(plan_seconds):.1f}, max {max(plan_seconds):.1f} "
               f"({sum(s <= 10 for s in plan_seconds)} of {len(plan_seconds)} within 10 s); beyond the plain-PyTorch "
               f"check process of the same entry (imports, build, one step): median "
               f"{statistics.median(beyond):.1f}, max {max(beyond):.1f}" if plan_seconds else "-"),
              *([f"- quiet `plan --tp 2`, one process at a time (`{data.get('plan_time_command')}`; revision "
                 + ", ".join(sorted({a["plan_time"]["revision"] for a in ran if "plan_time" in a})) + "): "
                 + plan_time_line([a["plan_time"] for a in ran if "plan_time" in a])]
                if any("plan_time" in a for a in ran) else []),
              "- families run: " + ", ".join(f"{f} {sum(a['family'] == f for a in ran)}"
                                             for f in (FAMILIES if hf else dict.fromkeys(a["family"] for a in ran))),
              *(["- entry styles run: " + ", ".join(f"`{s}` {sum(a['style'] == s for a in ran)}" for s in ("from", "module"))
                 + " (`from`: `from transformers import X`; `module`: `import transformers` + `transformers.X(config)`); "
                 "use_cache: " + ", ".join(f"{u} {sum(a['use_cache'] == u for a in ran)}" for u in ("default", "off", "-"))]
                if hf else []),
              ""]
    # Per architecture.
    lines += ["## Per architecture", "",
              "annotated = call sites with a split annotation (inspect); split = block parameter elements split by "
              "the TP=2 plan; plan s = wall seconds of `plan --tp 2` in the sweep; quiet plan s = the same, one "
              "process at a time (bench_plan_time.py), and in brackets the tool's own share (less the entry's "
              "import and build); total s = the whole architecture, checks included.", "",
              "| architecture | family | model class | " + ("style | use_cache | " if hf else "") + "params | annotated "
              "| plan s | quiet plan s | split | TP=2 | DP=2 | PP=2 | DP×TP | total s | notes |",
              "|---|---|---|" + ("---|---|" if hf else "") + "---:|---:|---:|---:|---:|---|---|---|---|---:|---|"]
    for a in ran:
        runs = by_run[a["arch"]]
        annotated = runs.get("inspect", {}).get("details", {}).get("annotated_sites")
        split = shares[a["arch"]]
        plan = runs.get("plan", {})
        plan_s = f"{plan['seconds']:.1f}" if plan.get("status") == "ok" else plan.get("status", "-")
        params = a["check"].get("params")
        cells = [a["arch"], a["family"], f"`{a['model_class']}`", *([a["style"], a["use_cache"]] if hf else []),
                 f"{params / 1e6:.2f}M" if params else "-", pct(annotated), plan_s, quiet_plan(a), pct(split)]
        cells += [runs.get(r, {}).get("status", "-") + (" (float64)" if runs.get(r, {}).get("details", {}).get("float64")
                                                        else "") for r in VERIFY_RUNS]
        cells.append(f"{a['seconds']:.0f}")
        notes = (["entry defines loss()"] if a.get("with_loss") and hf else []) + \
            (["kv heads = heads (fails with 2 in plain PyTorch)"] if a["check"].get("note") and hf else []) + \
            ([a["check"]["note"].replace("|", "\\|")] if a["check"].get("note") and not hf else [])
        cells.append("; ".join(notes))
        lines.append("| " + " | ".join(cells) + " |")
    # Failures grouped by cause.
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for a in ran:
        for r in a["records"]:
            if r["status"] not in ("pass", "ok"):
                key = group_key(r)
                groups.setdefault(key, []).append((a["arch"], MODE_TITLES[r["run"]], r["reason"]))
    lines += ["", "## Failures by cause", "",
              "Grouped by the reason with paths, positions and numbers stripped; each failure's own one-line reason "
              "below (refused: the first `error:` line; wrong: the errors verify measured; crash: the last exception "
              "line of the failing process and the frame that raised it; timeout: killed at the limit).", ""]
    if not groups:
        lines += ["None.", ""]
    for key, items in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines += [f"### {key} ({len(items)})", ""]
        lines += [f"- {arch} [{mode}]: `{reason}`" for arch, mode, reason in items]
        lines.append("")
    # Skipped and left out.
    lines += ["## Skipped: does not run at this config", "",
              "Construction or one forward + backward in plain PyTorch on CPU failed (outside the tool), so these "
              "are not tool failures.", ""]
    skip_groups: dict[str, list[tuple[str, str]]] = {}
    for a in skipped:
        skip_groups.setdefault(normalise(a["check"]["reason"]), []).append((a["arch"], a["check"]["reason"]))
    lines += [f"- {arch} ({a_family(archs, arch)}): `{reason}`"
              for _, items in sorted(skip_groups.items()) for arch, reason in items] or ["None."]
    if data.get("left_out"):
        lines += ["", "## Not tried", "",
                  "Model types of the same registries left out before any run: "
                  + "; ".join(f"{d['name']} ({d['reason']})" for d in data["left_out"]) + "."]
    if data.get("rechecks"):       # failures of a run re-checked by hand after later fixes, with the command
        lines += ["", "## Re-checked after the runs", "",
                  "Runs above that failed on a tool older than the revision named here, verified again by hand "
                  "(not counted in the summary):", ""]
        lines += [f"- {r['arch']} [{r['run']}] at `{r['revision']}`: {r['result']} (`{r['command']}`)"
                  for r in data["rechecks"]]
    return "\n".join(lines) + "\n"


LIBRARY_INTROS = {
    "timm": "Architectures come from `timm.list_models()`, one per module (architecture family), the one whose "
            "name says it is smallest; num_classes 10, 32×32 images, depth 2, width 64, 4 heads and no dropout "
            "where the model class's `__init__` takes them, else its own image size (the note says which)",
    "torchvision": "Architectures come from `torchvision.models.list_models()` per task (classification, "
                   "segmentation, video, optical flow; detection and quantized models left out), one per builder "
                   "module, the one with the fewest parameters; num_classes 10, 32×32 images (64 for segmentation, "
                   "128 for optical flow), no dropout where the model class takes them",
    "torchtitan": "Architectures come from torchtitan's model zoo (`torchtitan.models`), every `debugmodel*` flavor "
                  "built through the model's own `model_registry`, its inner attention replaced by causal SDPA "
                  "(FlexAttention has no backward on CPU)",
    "litgpt": "Architectures come from `litgpt.config.configs`, round-robin over organisations, each at 2 layers, "
              "width 64, 4 heads of 16 (kv heads: as many, 1 or 2, as the config's kind), intermediate 128, vocab "
              "128, at most 4 experts",
    "x-transformers": "x-transformers' decoder and encoder `TransformerWrapper`, `XTransformer` and "
                      "`ViTransformerWrapper` at width 64, 2 layers, 4 heads",
    "diffusers": "diffusers' `UNet2DModel`, `UNet2DConditionModel`, `DiTTransformer2DModel` and `AutoencoderKL` at "
                 "tiny configs (2 stages of 32 and 64 channels, 8 groups)",
    "torch.nn": "Models written in the entry around torch's own `nn.TransformerEncoder` and `nn.Transformer` "
                "(embedding, 2 layers of width 64 and 4 heads, head)",
}


def title_of(library: str) -> str:
    return f"Coverage of {library}{chr(39) if library.endswith('s') else chr(39) + 's'} architectures"


def render_all(files: dict[str, Path]) -> str:
    """COVERAGE.md from the results of one or more libraries: one library's report as it is;
    several under a table across libraries, each its own section."""
    reports = []
    for library, path in files.items():
        data = json.loads(path.read_text())
        path = path.resolve()
        data["results"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        reports.append((library, data))
    if len(reports) == 1:
        return render(reports[0][1])
    lines = ["# Coverage across libraries", "",
             "Written by `benchmarks/bench_coverage.py` from each library's results file (its docstring says how "
             "architectures are chosen and runs classified); one section per library below, each with its failures "
             "grouped by cause. Pass rates are of the architectures that run in plain PyTorch at their config; "
             f"split = TP=2 plans splitting ≥ {SPLIT_TARGET:.0%} of block parameters.", "",
             "| library | tried | run | TP=2 | DP=2 | PP=2 | DP×TP | split ≥ 75% | plan s median | results |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for library, data in reports:
        ran = [a for a in data["architectures"] if a["check"]["ok"]]
        by_run = {a["arch"]: {r["run"]: r for r in a["records"]} for a in ran}
        rates = []
        for run in VERIFY_RUNS:
            good = sum(by_run[a["arch"]].get(run, {}).get("status") == "pass" for a in ran)
            rates.append(f"{good} ({pct(good / len(ran) if ran else None)})")
        split = sum((split_of(by_run[a["arch"]]) or 0) >= SPLIT_TARGET for a in ran)
        plans = [by_run[a["arch"]]["plan"]["seconds"] for a in ran if by_run[a["arch"]].get("plan", {}).get("status") == "ok"]
        anchor = re.sub(r"[^\w\- ]", "", title_of(library).lower()).replace(" ", "-")    # GitHub's heading anchor
        lines.append(f"| [{library}](#{anchor}) | {len(data['architectures'])} | {len(ran)} | " + " | ".join(rates)
                     + f" | {split} | {f'{statistics.median(plans):.1f}' if plans else '-'} | `{data['results']}` |")
    lines.append("")
    for _, data in reports:
        lines += ["#" + line if line.startswith("#") else line for line in render(data).splitlines()]
    return "\n".join(lines) + "\n"


def quiet_plan(arch: dict) -> str:
    timed = arch.get("plan_time")
    if not timed:
        return "-"
    return f"{timed['plan_seconds']:.1f} ({timed['own_seconds']:.1f})" if timed["ok"] else "failed"


def plan_time_line(records: list[dict]) -> str:
    """bench_plan_time.py's records in one line: the plan's wall time, the entry's own import and
    build, and the difference, the tool's share."""
    ok = [r for r in records if r["ok"]]
    if not ok:
        return "no architecture planned"
    plans, own = [r["plan_seconds"] for r in ok], [r["own_seconds"] for r in ok]
    bases = [r["baseline_seconds"] for r in ok]
    return (f"`plan --tp 2` wall median {statistics.median(plans):.1f} s, max {max(plans):.1f} "
            f"({sum(s <= 10 for s in plans)} of {len(ok)} within 10 s); the entry's import and build alone "
            f"median {statistics.median(bases):.1f} s; the tool's own share median {statistics.median(own):.1f} s, "
            f"max {max(own):.1f} ({sum(s <= 10 for s in own)} of {len(ok)} within 10 s); 1-minute load median "
            f"{statistics.median(r['load'] for r in ok):.1f}" + (f"; {len(records) - len(ok)} failed" if len(ok) < len(records) else ""))


def run_lines(data: dict) -> list[str]:
    """Which command and revision each architecture's records come from. A single sweep: its
    command and revision; merged results (--merge): one line per sweep, with the architectures
    whose latest records it holds and the tool state each started on."""
    if not data.get("runs"):
        return [f"- command: `{data['command']}`",
                f"- revision: `{data['revision']}`, {data['date']}; {data['versions']}", *changed_during(data)]
    lines = ["- results merged from the sweeps below (`--merge`); each architecture's latest run is kept, and the "
             "tool state it started on is named after it (HEAD, + a hash of uncommitted changes to nnscaler_cst/ "
             "and rules/)"]
    for k, run in enumerate(data["runs"]):
        mine = [a for a in data["architectures"] if a.get("run") == k]
        if not mine:
            continue
        states: dict[str, list[str]] = {}
        for a in mine:
            states.setdefault(a.get("source") or "?", []).append(a["arch"])
        held = "; ".join(f"`{s}`: {', '.join(names)}" for s, names in states.items())
        lines.append(f"- sweep {k + 1}: `{run['command']}`; revision `{run['revision']}`, {run['date']}; "
                     f"{run['versions']}. Holds: {held}")
    return lines


def merge(base: dict, others: list[dict]) -> dict:
    """Results of several sweeps in one: an architecture's record from a later file replaces an
    earlier one (a re-run after a fix). Each sweep's command, revision and date are kept in
    `runs`, and each architecture names the run it comes from; hand re-checks of a replaced
    architecture are dropped (they described the older records)."""
    def as_run(data: dict) -> dict:
        return {k: data.get(k) for k in ("command", "revision", "date", "versions", "timeout", "jobs", "work")}

    merged = dict(base)
    if not merged.get("runs"):
        merged["runs"] = [as_run(base)]
        merged["architectures"] = [{**a, "run": 0} for a in base["architectures"]]
    by_name = {a["arch"]: a for a in merged["architectures"]}
    for data in others:
        merged["runs"].append(as_run(data))
        k = len(merged["runs"]) - 1
        for a in data["architectures"]:
            by_name[a["arch"]] = {**a, "run": k}
        replaced = {a["arch"] for a in data["architectures"]}
        merged["rechecks"] = [r for r in merged.get("rechecks", []) if r["arch"] not in replaced]
        merged["left_out"] = data.get("left_out", merged.get("left_out"))
        merged["timeout"] = max(merged.get("timeout") or 0, data.get("timeout") or 0)
        merged["jobs"] = max(merged.get("jobs") or 1, data.get("jobs") or 1)
    merged["architectures"] = list(by_name.values())
    for key in ("command", "revision", "date", "work"):
        merged.pop(key, None)
    merged["versions"] = merged["runs"][-1]["versions"]
    return merged


def changed_during(data: dict) -> list[str]:
    """A warning when architectures started on different states of nnscaler_cst/ and rules/."""
    by_state: dict[str, list[str]] = {}
    for a in data["architectures"]:
        by_state.setdefault(a.get("source", "?"), []).append(a["arch"])
    if len(by_state) < 2:
        return []
    return ["- **nnscaler_cst/ or rules/ changed during the sweep**; the state each architecture started on "
            "(HEAD+hash of uncommitted changes): " + "; ".join(f"`{s}`: {', '.join(n)}" for s, n in by_state.items())]


def a_family(archs: list[dict], name: str) -> str:
    return next(a["family"] for a in archs if a["arch"] == name)


# --------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--library", default="transformers", help=f"comma-separated libraries: {', '.join(LIBRARIES)} "
                   "(or all); each is swept in turn into its own results file")
    p.add_argument("--limit", type=int, default=64, help="stop after N architectures that run in plain PyTorch, "
                   "per library (0: all)")
    p.add_argument("--only", help="comma-separated architecture names (transformers' model types: llama,bert,t5,vit; "
                   "another library's names as --list prints them)")
    p.add_argument("--family", help=f"comma-separated families (transformers: {', '.join(FAMILIES)}; another "
                   "library's as --list prints them)")
    p.add_argument("--jobs", type=int, default=1, help="architectures run in parallel")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per tool run")
    p.add_argument("--check-timeout", type=float, default=180.0, help="seconds for the plain PyTorch check")
    p.add_argument("--work", help="work folder for entries and outputs (default: a new temporary folder, kept)")
    p.add_argument("--results", help="JSON results, one record per architecture x run (written after each "
                   "architecture); default benchmarks/coverage_results.json for transformers, "
                   "benchmarks/coverage_results_<library>.json for another library")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the markdown report (the default one holds every "
                   "library with a results file in benchmarks/)")
    p.add_argument("--render", nargs="*", metavar="RESULTS_JSON", help="only re-render --out (from these results "
                   "files, or from every library's default one)")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON", help="merge these sweeps' results into --results "
                   "(later files replace an architecture's records), then render --out")
    p.add_argument("--reclassify", action="store_true", help="with --render: classify the runs again from "
                   "the raw outputs in the work folder, and update the results file")
    p.add_argument("--entry", help="run the per-architecture runner on this entry file only")
    p.add_argument("--list", action="store_true", help="print the candidate architectures and exit")
    p.add_argument("--dry-run", action="store_true", help="write entries and run the plain check only")
    p.add_argument("--check-entry", help=argparse.SUPPRESS)      # internal: the plain check, in a subprocess
    args = p.parse_args()

    if args.check_entry:
        print(json.dumps(check_entry(Path(args.check_entry))))
        return
    args.libraries = list(LIBRARIES) if args.library == "all" else args.library.split(",")
    unknown = [lib for lib in args.libraries if lib not in LIBRARIES]
    if unknown:
        raise SystemExit(f"unknown library {', '.join(unknown)}; libraries: {', '.join(LIBRARIES)}")
    if args.results and len(args.libraries) > 1 and not args.render:
        raise SystemExit("--results names one library's file: give one --library with it")
    if args.dry_run:
        # a dry run writes entries to look at; it must not replace the recorded results
        args.work = args.work or tempfile.mkdtemp(prefix="nnscaler-coverage-")
        if args.out == str(DEFAULT_OUT):
            args.out = str(Path(args.work) / "COVERAGE.md")
    if args.entry:
        entry = Path(args.entry).resolve()
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="nnscaler-coverage-"))
        print(f"work folder: {work}", flush=True)
        for record in run_entry(entry, work, args.timeout, entry.stem):
            print(f"{record['run']:8s} {record['status']:8s} {record['seconds']:7.1f}s  {record['reason']}")
            if record["details"]:
                print(f"{'':26s}{json.dumps(record['details'])}")
        return
    written: dict[str, Path] = {}        # library -> the results file this command wrote or read
    if args.merge:
        target = results_path(args, args.libraries[0])
        data = merge(json.loads(target.read_text()), [json.loads(Path(f).read_text()) for f in args.merge])
        target.write_text(json.dumps(data, indent=1))
        written[data.get("library", "transformers")] = target
    elif args.render is not None:
        for name in args.render:
            data = json.loads(Path(name).read_text())
            if args.reclassify:
                reclassify(data)
                Path(name).write_text(json.dumps(data, indent=1))
            written[data.get("library", "transformers")] = Path(name)
    else:
        for library in args.libraries:
            if sweep(args, library):
                written[library] = results_path(args, library)
        if args.list:
            return
    if args.out == str(DEFAULT_OUT) or args.render == []:    # every library that has results
        defaults = {lib: ROOT / "benchmarks" / results_name(lib) for lib in LIBRARIES}
        written = {lib: written.get(lib, path) for lib, path in defaults.items()
                   if lib in written or path.is_file()}
    Path(args.out).write_text(render_all(written))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
