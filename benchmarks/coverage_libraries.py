"""Candidate architectures of the libraries other than transformers, for bench_coverage.py.

Each library's own registry is read, not a list of models typed here: timm's
``timm.list_models()`` (one model per module, the architecture family), torchvision's
``torchvision.models.list_models()`` per task (classification, segmentation, video, optical
flow; one model per builder module, the one with the fewest parameters by its weights'
metadata), torchtitan's ``torchtitan.models`` (every supported model's ``debugmodel*``
flavors, through its own ``model_registry``) and litgpt's ``litgpt.config.configs`` (one
name per organisation). x-transformers, diffusers and torch.nn have no registry of models:
their entries are the few model classes users build (decoder, encoder, encoder-decoder and
ViT wrappers; UNet2DModel, UNet2DConditionModel, DiTTransformer2DModel, AutoencoderKL;
nn.TransformerEncoder, nn.Transformer and nn.TransformerDecoder inside a small model with an embedding and a
head; nn.LSTM and nn.GRU language models; blocks of nn.MultiheadAttention written by hand, sequence first; a
small CNN of Conv2d + BatchNorm2d stages),
at tiny configs.

Tiny settings are given only where the model's class takes them: for timm and torchvision the
keyword arguments of the built model's ``__init__`` (read with ``inspect.signature``) decide
which of num_classes, img_size / image_size, depth, embed_dim, num_heads and the dropout
rates are passed. A candidate has one or more variants (entry texts), tried in order by the
plain PyTorch check; the first that runs is swept, and its note says which it was.

The order of candidates is round-robin over families, each family's candidates in a fixed
pseudo-random order seeded by the library and family name, so that --limit takes a spread
sample. This module writes entry texts only; it runs nothing of the tool.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import inspect
import os
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

LIBRARIES = ("transformers", "timm", "torchvision", "torchtitan", "litgpt", "x-transformers", "diffusers",
             "torch.nn")
BATCH, SEQ, VOCAB = 4, 16, 128

# Workaround for a CPU machine whose only torchvision wheel is a CUDA build: its _C extension
# cannot load (it links libtorch_cuda), and `import torchvision` -- reached also through timm,
# lightning/torchmetrics and diffusers (by transformers' image utilities) -- then fails
# registering fake kernels for torchvision::nms and ::qnms, whose schemas the extension would have
# defined. Defining those two schemas first lets it import; no model swept here calls them. It
# is applied in the bench's own process and, as a sitecustomize module on PYTHONPATH, in every
# process the bench starts (the plain check, the tool, verify's rank processes: a rank's
# model.py imports the library before the entry's code, so the entry file cannot carry it).
# Only where the extension does not load (torchvision_shim_needed), never where it works.
TORCHVISION_SHIM = """\
# Written by benchmarks/bench_coverage.py, only on a machine whose torchvision wheel is a CUDA build
# that cannot load on this CPU-only torch: define the two op schemas `import torchvision` needs.
import torch

try:
    torch.ops.torchvision.nms
except (AttributeError, RuntimeError):
    TORCHVISION_OPS = torch.library.Library("torchvision", "FRAGMENT")
    TORCHVISION_OPS.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    TORCHVISION_OPS.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
"""


@dataclass
class LibraryArch:
    """One candidate: its name, family (the round-robin group), the model class, and its entry
    variants, [(note, entry text)], made on demand (building a class to read its signature
    takes time)."""
    library: str
    name: str
    family: str
    model_class: str
    variants: Callable[[], list[tuple[str, str]]] = field(repr=False)
    config_class: str = "-"
    style: str = "-"
    use_cache: str = "-"
    overrides: dict = field(default_factory=dict)


def torchvision_shim_needed() -> bool:
    """Whether torchvision is installed and its _C extension fails to load here (so that
    `import torchvision` fails without TORCHVISION_SHIM)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch  # noqa: F401 - the extension's libtorch dependencies come from torch's own libraries
    folder = Path(list(spec.submodule_search_locations)[0])
    libs = sorted(folder.glob("_C*.so")) + sorted(folder.glob("_C*.pyd"))
    if not libs:
        return False
    try:
        ctypes.CDLL(str(libs[0]))
    except OSError:
        return True
    return False


def shim_site(work: Path) -> Path | None:
    """When needed: TORCHVISION_SHIM run in this process and written as work/_site/sitecustomize.py;
    returns that folder, to put first on the PYTHONPATH of the processes the bench starts."""
    if not torchvision_shim_needed():
        return None
    exec(compile(TORCHVISION_SHIM, "TORCHVISION_SHIM", "exec"), SHIM_GLOBALS)
    site = work / "_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(TORCHVISION_SHIM)
    return site


SHIM_GLOBALS: dict = {}    # keeps the shim's torch.library.Library alive: its schemas go with it


def widened(expr: str) -> str:
    """Source for `expr` in at least float32: a half output is summed in float32, and the float64
    run that verify asks for a second opinion keeps float64 (`.float()` rounded its loss back)."""
    return f"{expr}.to(torch.promote_types({expr}.dtype, torch.float32))"


def mean_square(expr: str) -> str:
    """Source for the mean square of `expr`, in at least float32."""
    return widened(expr) + ".pow(2).mean()"


def entry_text(arch_doc: str, imports: list[str], build: list[str], inputs: list[str], loss: str,
               helpers: str = "", loss_doc: str = "the mean square of the output, the same for every sample") -> str:
    """An entry file: docstring, imports (torch first), optional helpers, build(),
    example_inputs() and loss(output), loss_doc its comment."""
    indent = lambda lines: "\n".join("    " + line for line in lines)  # noqa: E731
    text = f'"""Entry file written by benchmarks/bench_coverage.py: {arch_doc}."""\nimport torch\n'
    text += "\n".join(imports) + "\n\n"
    if helpers:
        text += "\n" + helpers.strip("\n") + "\n\n"
    text += f"\ndef build():\n{indent(build)}\n\n\ndef example_inputs():\n{indent(inputs)}\n\n\n"
    text += f"def loss(output):\n    # {loss_doc}\n    return {loss}\n"
    return text


def round_robin(by_family: dict[str, list], library: str) -> list:
    """Families in a fixed pseudo-random order, each family's members likewise, then taken one
    from each family in turn."""
    families = sorted(by_family)
    random.Random(library).shuffle(families)
    queues = []
    for family in families:
        members = list(by_family[family])
        random.Random(f"{library}:{family}").shuffle(members)
        queues.append(members)
    ordered = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


def tiny_kwargs(cls: type, wanted: dict) -> dict:
    """The wanted keyword arguments that cls.__init__ takes as scalars (a tuple default, per
    stage, stays the library's)."""
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    out = {}
    for name, value in wanted.items():
        param = params.get(name)
        if param is None or isinstance(param.default, (tuple, list)):
            continue
        out[name] = value
    return out


def built_class(make: Callable[[], object]) -> type | None:
    """The class of the model a builder returns, built on the meta device (no memory, no
    init), or None when it cannot be built there."""
    import torch
    try:
        with torch.device("meta"):
            return type(make())
    except Exception:  # noqa: BLE001 - a builder that needs real tensors: no class-based settings
        return None


def call_args(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


# --------------------------------------------------------------------------- timm

# size words, smallest first; the words of one group name about the same size
SIZE_WORDS = (("atto",), ("femto",), ("pico",), ("nano",), ("micro",), ("tiny", "ti", "t", "xxs"), ("mini",),
              ("xs", "xsmall"), ("small", "s"), ("medium", "m"), ("base", "b"), ("large", "l"),
              ("xl", "xlarge"), ("xxl", "xxlarge"), ("huge", "h"), ("giant", "g"), ("gigantic",))
IMAGE_TINY = {"num_classes": 10, "img_size": 32, "image_size": 32, "depth": 2, "embed_dim": 64,
              "num_heads": 4, "drop_rate": 0.0, "drop_path_rate": 0.0, "attn_drop_rate": 0.0,
              "proj_drop_rate": 0.0, "dropout": 0.0, "attention_dropout": 0.0, "stochastic_depth_prob": 0.0}


def smallest_named(names: list[str]) -> str:
    """The member of a family whose name says it is smallest: by its size word (a `_`-separated
    token, digits after it allowed: cait_xxs24_224 before cait_s24_224 before cait_m36_384;
    only before a token that is a number: levit_384_s8's s8 is a stride; a name without one
    counts as base size), then the number after the word, then the shortest name."""
    rank_of = {word: rank for rank, words in enumerate(SIZE_WORDS) for word in words}
    base = rank_of["base"]

    def rank(name):
        tokens = name.lower().split("_")
        tokens = tokens[:next((k for k, token in enumerate(tokens) if token.isdigit()), len(tokens))]
        sizes = [(rank_of[m.group(1)], int(m.group(2) or 0))
                 for m in (re.fullmatch(r"([a-z]+)(\d*)", token) for token in tokens) if m and m.group(1) in rank_of]
        return (*min(sizes, default=(base, 0)), len(name), name)
    return min(names, key=rank)


def timm_archs() -> list[LibraryArch]:
    import timm
    from timm.models import _registry as registry
    by_module: dict[str, list[str]] = {}
    for name in timm.list_models():
        by_module.setdefault(registry._model_to_module.get(name, "?"), []).append(name)
    by_family = {}
    for module, names in by_module.items():
        name = smallest_named(names)
        by_family[module] = [LibraryArch("timm", name, module, f"timm.create_model({name!r})",
                                         lambda name=name: timm_variants(name))]
    return round_robin(by_family, "timm")


def timm_variants(name: str) -> list[tuple[str, str]]:
    import timm
    cls = built_class(lambda: timm.create_model(name, pretrained=False))
    cfg = timm.models.get_pretrained_cfg(name)
    channels, *size = (cfg.input_size if cfg is not None and cfg.input_size else (3, 224, 224))
    tiny = tiny_kwargs(cls, IMAGE_TINY) if cls is not None else {}
    small = {k: v for k, v in tiny.items() if k in ("num_classes", "depth") or "drop" in k}
    variants, seen = [], []
    for note, kwargs, hw in (("tiny: " + call_args(tiny), tiny, (32, 32)),
                             ("its own image size: " + call_args(small), small, tuple(size))):
        if (kwargs, hw) in seen:
            continue
        seen.append((kwargs, hw))
        kw = {"pretrained": False, **kwargs}
        text = entry_text(
            f"timm's {name} ({cls.__name__ if cls else '?'}) at {note}",
            ["import timm"], [f"return timm.create_model({name!r}, {call_args(kw)})"],
            [f"return (torch.randn({BATCH}, {channels}, {hw[0]}, {hw[1]}),)"],
            mean_square("output"))
        variants.append((note, text))
    return variants


# --------------------------------------------------------------------------- torchvision

TORCHVISION_TASKS = {  # task -> (torchvision.models submodule, input builder, loss)
    "classification": (None, "return (torch.randn({b}, 3, {s}, {s}),)", mean_square("output")),
    "segmentation": ("segmentation", "return (torch.randn({b}, 3, {s}, {s}),)", mean_square('output["out"]')),
    "video": ("video", "return (torch.randn({b}, 3, {t}, {s}, {s}),)", mean_square("output")),
    "optical_flow": ("optical_flow", "return (torch.randn({b}, 3, {s}, {s}), torch.randn({b}, 3, {s}, {s}))",
                     mean_square("output[-1]")),
}
VIDEO_FRAMES = 4      # frames of a video input, or the fewest its weights accept (MViT's builder pins 16)


def torchvision_archs() -> list[LibraryArch]:
    import torchvision.models as models
    by_task_module: dict[tuple[str, str], list[str]] = {}
    for task, (sub, _, _) in TORCHVISION_TASKS.items():
        names = models.list_models(module=getattr(models, sub) if sub else None)
        others = set() if sub else {n for t, (s, _, _) in TORCHVISION_TASKS.items() if s
                                     for n in models.list_models(module=getattr(models, s))}
        for name in names:
            module = models.get_model_builder(name).__module__
            if name in others or ".quantization" in module or ".detection" in module:
                continue
            by_task_module.setdefault((task, module.rsplit(".", 1)[-1]), []).append(name)
    by_family: dict[str, list[LibraryArch]] = {}
    for (task, module), names in sorted(by_task_module.items()):
        name = min(names, key=lambda n: (num_params(models, n), n))
        by_family.setdefault(task, []).append(
            LibraryArch("torchvision", name, task, f"torchvision.models.{name}",
                        lambda name=name, task=task: torchvision_variants(name, task)))
    return round_robin(by_family, "torchvision")


def num_params(models, name: str) -> float:
    try:
        return models.get_model_weights(name).DEFAULT.meta.get("num_params", float("inf"))
    except Exception:  # noqa: BLE001 - a model without weights: last among its family
        return float("inf")


FIRST_TENSOR = '''
def first_tensor(output):
    """The output, or the first tensor of a tuple output: a classifier with auxiliary heads
    (GoogLeNet, Inception v3) returns its logits first in a namedtuple while training."""
    return output[0] if isinstance(output, tuple) else output
'''


def torchvision_loss(task: str) -> str:
    """The task's loss source, taken on first_tensor(output) (FIRST_TENSOR, a helper of the entry)
    less 1: ViT's head is zero-initialized, where the output's mean square has no gradient at all
    (TORCHTITAN_LOSS_DOC)."""
    return re.sub(r"\boutput(\[[^\]]*\])?", r"(first_tensor(output)\1 - 1)", TORCHVISION_TASKS[task][2])


def torchvision_variants(name: str, task: str) -> list[tuple[str, str]]:
    """Tiny settings the class takes; then only the size, classes and dropouts (a builder that
    passes the widths itself refuses them twice); then its own sizes, with and without the
    dropouts set to 0. A builder that would
    download backbone weights (segmentation) gets weights_backbone=None."""
    import torchvision.models as models
    builder = models.get_model_builder(name)
    fixed_args = {"weights": None}
    if "weights_backbone" in inspect.signature(builder).parameters:
        fixed_args["weights_backbone"] = None
    cls = built_class(lambda: models.get_model(name, **fixed_args))
    try:
        meta = models.get_model_weights(name).DEFAULT.meta
    except Exception:  # noqa: BLE001 - no weights metadata
        meta = {}
    min_size = max(meta.get("min_size", (1, 1)))
    frames = max(VIDEO_FRAMES, meta.get("min_temporal_size", 1))
    _, inputs, _ = TORCHVISION_TASKS[task]
    loss = torchvision_loss(task)
    wanted = {k: v for k, v in IMAGE_TINY.items() if k != "num_classes" or task != "optical_flow"}
    tiny = tiny_kwargs(cls, wanted) if cls is not None else {}
    side = 128 if task == "optical_flow" else 64 if task == "segmentation" else 32
    plain = {k: v for k, v in tiny.items() if k == "num_classes" or "drop" in k or "prob" in k}
    sized = {k: v for k, v in tiny.items() if k in plain or k in ("image_size", "img_size")}
    classes = {k: v for k, v in tiny.items() if k == "num_classes"}
    variants, seen = [], []
    for note, kwargs in (("tiny: " + call_args(tiny), tiny), ("its widths: " + call_args(sized), sized),
                         ("its sizes: " + call_args(plain), plain),
                         ("its sizes and dropouts: " + call_args(classes), classes)):
        # a size given to the class sets the input; else the smallest its weights accept, at least `side`
        size = kwargs.get("image_size", kwargs.get("img_size", max(side, min_size)))
        if (kwargs, size) in seen:
            continue
        seen.append((kwargs, size))
        text = entry_text(f"torchvision's {name} ({task}) at {note}", ["import torchvision"],
                          [f"return torchvision.models.get_model({name!r}, {call_args({**fixed_args, **kwargs})})"],
                          [inputs.format(b=BATCH, s=size, t=frames)], loss, helpers=FIRST_TENSOR,
                          loss_doc=TORCHTITAN_LOSS_DOC)
        variants.append((note, text))
    return variants


# --------------------------------------------------------------------------- torchtitan

TORCHTITAN_SDPA = '''
def causal_sdpa(config):
    """The config with every FlexAttention / varlen inner attention replaced by causal SDPA:
    FlexAttention has no backward on CPU and varlen attention needs CUDA; one document per
    sequence here, so causal SDPA computes the same attention."""
    if isinstance(config, (FlexAttention.Config, VarlenAttention.Config)):
        return ScaledDotProductAttention.Config()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            new = causal_sdpa(value)
            if new is not value:
                object.__setattr__(config, f.name, new)
    elif isinstance(config, list):
        config[:] = [causal_sdpa(value) for value in config]
    return config
'''


# A model whose final norm is zero-initialized (torchtitan has such) outputs all zeros at init,
# where the output's mean square has an all-zero gradient, which verify rejects as
# checking nothing. The distance from 1 has a gradient at zero output.
TORCHTITAN_LOSS_DOC = "the mean square distance of the output from 1 (a gradient also where it is all zero)"


def torchtitan_archs() -> list[LibraryArch]:
    import torchtitan.models as zoo
    by_family: dict[str, list[LibraryArch]] = {}
    for model in sorted(zoo._supported_models):
        try:
            module = importlib.import_module(f"torchtitan.models.{model}")
            tables = [list(v) for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict)]
        except Exception:  # noqa: BLE001 - its flavors are read from its source: the plain check reports why it fails
            tables = [configs_in_source(Path(importlib.util.find_spec(f"torchtitan.models.{model}").origin))]
        # the debug flavors, however spelled (`debugmodel_moe`, flux's `flux-debug`)
        flavors = sorted(f for t in tables for f in t if "debug" in f)
        for flavor in flavors:
            name = model if flavor == "debugmodel" else f"{model}:{flavor.removeprefix('debugmodel_')}"
            by_family.setdefault(model, []).append(LibraryArch(
                "torchtitan", name, model, f"torchtitan.models.{model} {flavor}",
                lambda model=model, flavor=flavor: torchtitan_variants(model, flavor)))
    return round_robin(by_family, "torchtitan")


def configs_in_source(path: Path) -> list[str]:
    """The keys of the module-level `*_configs = {...}` dicts of a model package that does not
    import here (a dependency missing): its flavors are listed all the same, and their plain
    check says why they cannot run."""
    import ast
    keys = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id.endswith("_configs") for t in node.targets):
            keys += [k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return keys


def torchtitan_variants(model: str, flavor: str) -> list[tuple[str, str]]:
    """In float32, else in bfloat16 as torchtitan trains (its mixed precision holds the
    parameters in bfloat16: gpt_oss's experts compute in bfloat16 whatever they are given);
    with torchtitan's default SPMD backend, else with "partial_dtensor", which its trainer
    selects from the config (spmd_types' type assertions need a device mesh, which one device
    has none of: muse_glimmer)."""
    variants = []
    for backend, cast in ((None, None), (None, "bfloat16"), ("partial_dtensor", None),
                          ("partial_dtensor", "bfloat16")):
        note = "".join([f", {backend} backend" if backend else "", f", {cast}" if cast else ""])
        text = entry_text(
            f"torchtitan's {model} {flavor} config from its model_registry, inner attention as causal SDPA{note}",
            ["import dataclasses", "", f"from torchtitan.models import {model}",
             "from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention",
             *(["from torchtitan.distributed.utils import set_spmd_backend"] if backend else [])],
            [*([f"set_spmd_backend({backend!r})"] if backend else []),
             f"config = causal_sdpa({model}.model_registry({flavor!r}).model)", "model = config.build()",
             "model.init_states()", *([f"model = model.to(torch.{cast})"] if cast else []), "return model"],
            [f"return (torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})),)"], f"({widened('output')} - 1).pow(2).mean()",
            helpers=TORCHTITAN_SDPA, loss_doc=TORCHTITAN_LOSS_DOC)
        variants.append((f"{flavor}, causal SDPA{note}", text))
    return variants


# --------------------------------------------------------------------------- litgpt

def litgpt_archs() -> list[LibraryArch]:
    from litgpt.config import configs
    by_family: dict[str, list[LibraryArch]] = {}
    for config in configs:
        org = (config.get("hf_config") or {}).get("org", "?")
        by_family.setdefault(org, []).append(LibraryArch(
            "litgpt", config["name"], org, f"litgpt GPT({config['name']})",
            lambda name=config["name"]: litgpt_variants(name)))
    return round_robin(by_family, "litgpt")


def litgpt_tiny(name: str) -> dict:
    """Small sizes for the fields this config uses, keeping its kind of attention (multi-head,
    multi-query or grouped) and of MLP (dense or experts)."""
    from litgpt.config import Config
    config = Config.from_name(name)
    groups = 4 if config.n_query_groups == config.n_head else 1 if config.n_query_groups == 1 else 2
    out = {"n_layer": 2, "n_embd": 64, "n_head": 4, "head_size": 16, "n_query_groups": groups,
           "intermediate_size": 128, "vocab_size": VOCAB, "padded_vocab_size": VOCAB, "block_size": 64}
    if config.n_expert:
        out.update(n_expert=min(config.n_expert, 4), n_expert_per_token=min(config.n_expert_per_token, 2),
                   moe_intermediate_size=32)
    if config.first_k_dense_replace:
        out["first_k_dense_replace"] = 1
    return out


def litgpt_variants(name: str) -> list[tuple[str, str]]:
    tiny = litgpt_tiny(name)
    variants = []
    for note, kwargs in (("tiny: " + call_args(tiny), tiny),
                         ("2 layers, vocab 128", {"n_layer": 2, "vocab_size": VOCAB, "padded_vocab_size": VOCAB})):
        text = entry_text(f"litgpt's {name} at {note}", ["from litgpt.config import Config", "from litgpt.model import GPT"],
                          [f"return GPT(Config.from_name({name!r}, {call_args(kwargs)}))"],
                          [f"return (torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})),)"],
                          mean_square("output"))
        variants.append((note, text))
    return variants


# --------------------------------------------------------------------------- fixed tables

def fixed(library: str, name: str, family: str, model_class: str, imports: list[str], build: str,
          inputs: str, loss: str = mean_square("output"), helpers: str = "") -> LibraryArch:
    text = entry_text(f"{library}'s {model_class} ({family}) at a tiny config", imports, [f"return {build}"],
                      [f"return {inputs}"], loss, helpers=helpers)
    return LibraryArch(library, name, family, model_class, lambda: [("tiny", text)])


TOKENS = f"(torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})),)"


def x_transformers_archs() -> list[LibraryArch]:
    layers = "dim=64, depth=2, heads=4"
    imports = ["from x_transformers import Decoder, Encoder, TransformerWrapper, ViTransformerWrapper, XTransformer"]
    return [
        fixed("x-transformers", "decoder", "decoder", "TransformerWrapper(Decoder)", imports,
              f"TransformerWrapper(num_tokens={VOCAB}, max_seq_len=64, attn_layers=Decoder({layers}))", TOKENS),
        fixed("x-transformers", "encoder", "encoder", "TransformerWrapper(Encoder)", imports,
              f"TransformerWrapper(num_tokens={VOCAB}, max_seq_len=64, attn_layers=Encoder({layers}))", TOKENS),
        fixed("x-transformers", "encoder-decoder", "encoder-decoder", "XTransformer", imports,
              f"XTransformer(dim=64, enc_num_tokens={VOCAB}, enc_depth=2, enc_heads=4, enc_max_seq_len=64, "
              f"dec_num_tokens={VOCAB}, dec_depth=2, dec_heads=4, dec_max_seq_len=64)",
              f"(torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})), torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})))",
              "output  # XTransformer returns the decoder's cross-entropy"),
        fixed("x-transformers", "vit", "vision", "ViTransformerWrapper", imports,
              f"ViTransformerWrapper(image_size=32, patch_size=8, num_classes=10, attn_layers=Encoder({layers}))",
              f"(torch.randn({BATCH}, 3, 32, 32),)"),
    ]


def diffusers_archs() -> list[LibraryArch]:
    timestep = f"torch.randint(0, 1000, ({BATCH},))"
    return [
        fixed("diffusers", "unet2d", "unet", "UNet2DModel", ["from diffusers import UNet2DModel"],
              'UNet2DModel(sample_size=32, in_channels=3, out_channels=3, layers_per_block=1, '
              'block_out_channels=(32, 64), down_block_types=("DownBlock2D", "AttnDownBlock2D"), '
              'up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8, attention_head_dim=8)',
              f'{{"sample": torch.randn({BATCH}, 3, 32, 32), "timestep": {timestep}}}',
              mean_square("output.sample")),
        fixed("diffusers", "unet2d_condition", "unet", "UNet2DConditionModel", ["from diffusers import UNet2DConditionModel"],
              'UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, '
              'block_out_channels=(32, 64), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), '
              'up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8, '
              'norm_num_groups=8)',
              f'{{"sample": torch.randn({BATCH}, 4, 16, 16), "timestep": {timestep}, '
              f'"encoder_hidden_states": torch.randn({BATCH}, 8, 32)}}',
              mean_square("output.sample")),
        fixed("diffusers", "dit", "transformer", "DiTTransformer2DModel", ["from diffusers import DiTTransformer2DModel"],
              "DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, num_layers=2, "
              "sample_size=8, patch_size=2, num_embeds_ada_norm=1000)",
              f'{{"hidden_states": torch.randn({BATCH}, 4, 8, 8), "timestep": {timestep}, '
              f'"class_labels": torch.randint(0, 1000, ({BATCH},))}}',
              mean_square("output.sample")),
        fixed("diffusers", "autoencoder_kl", "vae", "AutoencoderKL", ["from diffusers import AutoencoderKL"],
              'AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", '
              '"DownEncoderBlock2D"), up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), '
              "block_out_channels=(32, 64), latent_channels=4, norm_num_groups=8, sample_size=32)",
              f'{{"sample": torch.randn({BATCH}, 3, 32, 32)}}', mean_square("output.sample")),
    ]


TORCH_NN_MODELS = '''
class EncoderLM(nn.Module):
    """Tokens -> nn.TransformerEncoder -> logits."""

    def __init__(self, vocab=128, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


class Seq2Seq(nn.Module):
    """Source and target tokens -> nn.Transformer (causal target mask) -> logits."""

    def __init__(self, vocab=128, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, heads, num_encoder_layers=layers, num_decoder_layers=layers,
                                          dim_feedforward=128, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1))
        return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask))


class DecoderLM(nn.Module):
    """Tokens -> nn.TransformerDecoder alone (causal mask, its own input as memory) -> logits."""

    def __init__(self, vocab=128, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerDecoderLayer(dim, heads, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        return self.head(self.decoder(x, x, tgt_mask=mask, tgt_is_causal=True))


class RecurrentLM(nn.Module):
    """Tokens -> a 2-layer nn.LSTM or nn.GRU (batch first) -> logits."""

    def __init__(self, cell="lstm", vocab=128, dim=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


class AttentionBlock(nn.Module):
    """Pre-norm block around nn.MultiheadAttention, sequence first (batch_first=False)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MultiheadLM(nn.Module):
    """Tokens -> blocks of nn.MultiheadAttention written by hand, (seq, batch, dim) -> logits."""

    def __init__(self, vocab=128, dim=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(AttentionBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens).transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x)).transpose(0, 1)


def conv_bn(c_in, c_out, stride=1):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Images -> an nn.Sequential of Conv2d + BatchNorm2d + ReLU stages -> pooled logits."""

    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 16), conv_bn(16, 32, 2), conv_bn(32, 32), conv_bn(32, 64, 2))
        self.head = nn.Linear(64, classes)

    def forward(self, images):
        return self.head(self.features(images).mean((2, 3)))
'''


def torch_nn_archs() -> list[LibraryArch]:
    imports = ["from torch import nn"]
    return [
        fixed("torch.nn", "transformer_encoder", "encoder", "nn.TransformerEncoder", imports, "EncoderLM()", TOKENS,
              helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "transformer", "encoder-decoder", "nn.Transformer", imports, "Seq2Seq()",
              f"(torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})), torch.randint(0, {VOCAB}, ({BATCH}, {SEQ})))",
              helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "transformer_decoder", "decoder", "nn.TransformerDecoder", imports, "DecoderLM()", TOKENS,
              helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "lstm", "recurrent", "nn.LSTM", imports, 'RecurrentLM("lstm")', TOKENS,
              helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "gru", "recurrent", "nn.GRU", imports, 'RecurrentLM("gru")', TOKENS,
              helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "multihead_attention", "decoder", "nn.MultiheadAttention blocks", imports, "MultiheadLM()",
              TOKENS, helpers=TORCH_NN_MODELS),
        fixed("torch.nn", "cnn", "vision", "nn.Conv2d + nn.BatchNorm2d", imports, "SmallCNN()",
              f"(torch.randn({BATCH}, 3, 32, 32),)", helpers=TORCH_NN_MODELS),
    ]


ENUMERATORS = {"timm": timm_archs, "torchvision": torchvision_archs, "torchtitan": torchtitan_archs,
               "litgpt": litgpt_archs, "x-transformers": x_transformers_archs, "diffusers": diffusers_archs,
               "torch.nn": torch_nn_archs}
DISTRIBUTIONS = {"timm": "timm", "torchvision": "torchvision", "torchtitan": "torchtitan", "litgpt": "litgpt",
                 "x-transformers": "x-transformers", "diffusers": "diffusers", "torch.nn": "torch"}


IMPORT_TORCHVISION = ("timm", "torchvision", "litgpt", "diffusers")   # import it (litgpt by torchmetrics, diffusers by
                                                                     # transformers' image utilities) when installed


# torchvision lives outside site-packages here (an installed but unloadable torchvision breaks
# `from transformers import ...` for everyone): `pip install --no-deps --target DIR torchvision`,
# DIR from $BENCH_TORCHVISION, else /opt/bench-torchvision. Only the libraries that need it get
# DIR on their path.
TORCHVISION_TARGET = Path(os.environ.get("BENCH_TORCHVISION", "/opt/bench-torchvision"))
NEED_TORCHVISION = ("timm", "torchvision")


def library_archs(library: str, work: Path) -> tuple[list[LibraryArch], list[dict], list[Path]]:
    """The candidates of one library (not transformers), in sweep order, those left out, and
    the folders to put first on the PYTHONPATH of the processes the bench starts."""
    first = []
    if library in NEED_TORCHVISION and TORCHVISION_TARGET.is_dir():
        sys.path.insert(0, str(TORCHVISION_TARGET))
        first.append(TORCHVISION_TARGET)
    site = shim_site(work) if library in IMPORT_TORCHVISION else None
    return ENUMERATORS[library](), [], ([site] if site else []) + first


def library_version(library: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"{library} {version(DISTRIBUTIONS.get(library, library))}"
    except PackageNotFoundError:
        return f"{library} not installed"


def results_name(library: str) -> str:
    """The results file of a library in benchmarks/ (transformers keeps its historic name)."""
    return "coverage_results.json" if library == "transformers" else \
        f"coverage_results_{library.replace('.', '_').replace('-', '_')}.json"
