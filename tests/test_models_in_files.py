"""Spec: a model whose classes live in several files of a package is written out as mirrors.

The package here has four files, as a library or a user's own package would: a registry
(`registry.py`, whose decorator refuses a second entry under one name), an attention class
(`attention.py`), blocks that build it through a default argument (`blocks.py`) and the model
with its registered builder (`model.py`, the block loop counting its blocks with enumerate).
The entry file builds the model through the registry. What must hold:

- each file whose definitions the plan changes gets a mirror at its package-relative path in
  the output, holding only the changed definitions and those that build or call them; the rest
  is imported from the installed package; the program file imports the rewritten classes;
- the registry's decorator never runs again (the package imports once, with its entries);
- `--diff` shows every mirrored file against the same definitions before the rewrite, and
  `--check` reads the mirrors; a hand edit in a mirror survives a regeneration;
- the output verifies against the single-device model on gloo (slow).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TIMEOUT_S = 600

PACKAGE = {
    "__init__.py": """
        from .registry import create
        from . import model  # noqa: F401 - registers the builders
    """,
    "registry.py": """
        _BUILDERS = {}


        def register(name):
            def add(builder):
                if name in _BUILDERS:
                    raise ValueError(f"a builder is already registered under {name!r}")
                _BUILDERS[name] = builder
                return builder
            return add


        def create(name, **kwargs):
            return _BUILDERS[name](**kwargs)


        def traceable(cls):
            return cls
    """,
    "attention.py": """
        import torch.nn as nn
        import torch.nn.functional as F

        from .registry import traceable


        @traceable
        class Attention(nn.Module):
            def __init__(self, dim, heads):
                super().__init__()
                self.heads = heads
                self.qkv = nn.Linear(dim, 3 * dim)
                self.proj = nn.Linear(dim, dim)

            def forward(self, x):
                B, T, C = x.shape
                q, k, v = self.qkv(x).split(C, dim=2)
                q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.proj(y.transpose(1, 2).reshape(B, T, C))


        def unused_helper(x):
            return x
    """,
    "blocks.py": """
        import torch.nn as nn

        from .attention import Attention


        class Mlp(nn.Module):
            def __init__(self, dim, hidden):
                super().__init__()
                self.fc1 = nn.Linear(dim, hidden)
                self.fc2 = nn.Linear(hidden, dim)

            def forward(self, x):
                return self.fc2(nn.functional.gelu(self.fc1(x)))


        class Block(nn.Module):
            def __init__(self, dim, heads, attn_layer=Attention):
                super().__init__()
                self.ln1 = nn.LayerNorm(dim)
                self.attn = attn_layer(dim, heads)
                self.ln2 = nn.LayerNorm(dim)
                self.mlp = Mlp(dim, 4 * dim)

            def forward(self, x, scale):
                x = x + scale * self.attn(self.ln1(x))
                return x + self.mlp(self.ln2(x))
    """,
    "model.py": """
        import torch.nn as nn
        import torch.nn.functional as F

        from .blocks import Block
        from .registry import register

        SCALES = (1.0, 0.5, 0.25, 0.125)


        class TinyNet(nn.Module):
            def __init__(self, vocab=64, dim=32, heads=4, layers=4):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
                self.norm = nn.LayerNorm(dim)
                self.head = nn.Linear(dim, vocab, bias=False)

            def forward(self, idx, targets):
                x = self.embed(idx)
                for i, block in enumerate(self.blocks):
                    x = block(x, SCALES[i])
                logits = self.head(self.norm(x))
                return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


        @register("tiny")
        def tiny(**kwargs):
            return TinyNet(**kwargs)
    """,
}

ENTRY = """
    import torch
    import tinypkg


    def build():
        torch.manual_seed(0)
        return tinypkg.create("tiny")


    def example_inputs():
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g)
"""


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tinypkg").mkdir()
    for name, text in PACKAGE.items():
        (tmp_path / "tinypkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    (tmp_path / "entry.py").write_text(textwrap.dedent(ENTRY).lstrip("\n"))
    return tmp_path


def generated(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py")
            if ".nnscaler" not in p.parts and "__pycache__" not in p.parts}


def test_tensor_parallel_writes_a_mirror_per_changed_file(project):
    result = cli("entry.py", "--tp", "2", "-o", "out", cwd=project)
    assert result.returncode == 0, result.stderr
    out = project / "out"
    assert generated(out) == {"__init__.py", "_comm.py", "model.py", "train.py", "tinypkg/__init__.py",
                              "tinypkg/attention.py", "tinypkg/blocks.py", "tinypkg/model.py"}
    attention = (out / "tinypkg/attention.py").read_text()
    assert "self.qkv = nn.Linear(dim, 3 * dim // 2)" in attention
    assert "unused_helper" not in attention                       # unchanged: the installed one serves
    assert "from tinypkg.attention import F, nn, traceable" in attention   # its class decorator too
    blocks = (out / "tinypkg/blocks.py").read_text()
    assert "from .attention import Attention" in blocks          # the default argument names the mirror's
    model = (out / "tinypkg/model.py").read_text()
    assert "class TinyNet" in model and "def tiny" not in model  # the registered builder is not defined again
    assert "from tinypkg.model import F, SCALES, nn" in model
    assert "from ..registry" not in model and "register" not in model
    program = (out / "model.py").read_text()
    assert "from .tinypkg.model import TinyNet  # rewritten" in program
    # built through the registry: the library class builds the rewritten one while build() runs
    assert "from tinypkg.model import TinyNet as _library_TinyNet" in program


def test_data_parallel_alone_mirrors_nothing(project):
    result = cli("entry.py", "--dp", "2", "-o", "out", cwd=project)
    assert result.returncode == 0, result.stderr
    assert generated(project / "out") == {"__init__.py", "_comm.py", "model.py", "train.py"}


@pytest.mark.slow     # over 5 s: keeps the quick subset under 3 minutes
def test_diff_shows_each_mirror_against_its_source_definitions(project):
    result = cli("entry.py", "--tp", "2", "-o", "out", "--diff", "0", cwd=project)
    assert result.returncode == 0, result.stderr
    diff = result.stdout
    for name in ("attention", "blocks", "model"):
        assert f"--- tinypkg/{name}.py" in diff and f"+++ out/tinypkg/{name}.py" in diff
    assert "\n-        self.qkv = nn.Linear(dim, 3 * dim)\n" in diff
    assert "\n+        self.qkv = nn.Linear(dim, 3 * dim // 2)" in diff
    assert "-    def forward" not in diff          # only what the plan changed differs


@pytest.mark.slow     # over 10 s: keeps the quick subset under 3 minutes
def test_check_and_hand_edits_cover_the_mirrors(project):
    assert cli("entry.py", "--tp", "2", "-o", "out", cwd=project).returncode == 0
    mirror = project / "out" / "tinypkg" / "attention.py"
    assert cli("entry.py", "--tp", "2", "-o", "out", "--check", cwd=project).returncode == 0
    edited = mirror.read_text().replace("        self.heads = heads\n",
                                        "        self.heads = heads  # reviewed\n")
    mirror.write_text(edited)
    assert cli("entry.py", "--tp", "2", "-o", "out", "--check", cwd=project).returncode == 0   # a clean edit
    (project / "tinypkg" / "attention.py").write_text(
        (project / "tinypkg" / "attention.py").read_text().replace("F.scaled_dot_product_attention(q, k, v, ",
                                                                   "F.scaled_dot_product_attention(q, k, v, scale=0.5, "))
    stale = cli("entry.py", "--tp", "2", "-o", "out", "--check", cwd=project)
    assert stale.returncode == 1 and "out/tinypkg/attention.py" in stale.stdout + stale.stderr
    assert cli("entry.py", "--tp", "2", "-o", "out", cwd=project).returncode == 0
    text = mirror.read_text()
    assert "# reviewed" in text and "scale=0.5" in text


@pytest.mark.slow
@pytest.mark.parametrize("mode", [("--tp", "2"), ("--pp", "2", "--micro-batches", "2")], ids=["tp2", "pp2"])
def test_the_mirrored_output_verifies(project, mode):
    result = cli("verify", "entry.py", *mode, "-o", "out", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASSED" in result.stdout


# A layer built through two helpers, as timm's ClassifierHead builds its fc (create_classifier ->
# _create_fc): only the inner one constructs the layer and changes, but the outer one, which
# neither constructs a module nor ran in the step, calls it and must come from the mirror too,
# or the mirrored class builds the installed, whole-size layer.
HELPER_PACKAGE = {
    "__init__.py": "",
    "layers.py": """
        import torch
        import torch.nn as nn


        def _create_fc(dim, hidden):
            return nn.Linear(dim, hidden)


        def create_fc(dim, hidden):
            return _create_fc(dim, hidden)


        class Mlp(nn.Module):
            def __init__(self, dim, hidden):
                super().__init__()
                self.fc1 = create_fc(dim, hidden)
                self.fc2 = nn.Linear(hidden, dim)

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x)))
    """,
    "net.py": """
        import torch.nn as nn

        from .layers import Mlp


        class Net(nn.Module):
            def __init__(self, dim=16, hidden=64):
                super().__init__()
                self.mlp = Mlp(dim, hidden)
                self.out = nn.Linear(dim, 4)

            def forward(self, x):
                return self.out(x + self.mlp(x)).pow(2).mean()
    """,
}

HELPER_ENTRY = """
    import torch
    from helperpkg.net import Net


    def build():
        torch.manual_seed(0)
        return Net()


    def example_inputs():
        return (torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1)),)
"""


def test_a_helper_calling_a_rewritten_constructor_helper_is_mirrored(tmp_path):
    (tmp_path / "helperpkg").mkdir()
    for name, text in HELPER_PACKAGE.items():
        (tmp_path / "helperpkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    (tmp_path / "entry.py").write_text(textwrap.dedent(HELPER_ENTRY).lstrip("\n"))
    result = cli("entry.py", "--tp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    layers = (tmp_path / "out" / "helperpkg" / "layers.py").read_text()
    assert "return nn.Linear(dim, hidden // 2)" in layers
    assert "def create_fc(dim, hidden):" in layers and "import create_fc" not in layers


# Layers in one subpackage importing a sibling subpackage's module inside a constructor (to
# avoid a circular import, as diffusers' Attention imports `.normalization`): the mirror of
# the layers' file sits in the output's package, where the source's relative import names a
# module the output does not hold; a norm the rewrite changes too must come from its mirror.
LOCAL_IMPORT_PACKAGE = {
    "__init__.py": "",
    "norms/__init__.py": "",
    "norms/act.py": """
        import torch
        import torch.nn as nn


        class SquaredReLU(nn.Module):
            def forward(self, x):
                return torch.relu(x).pow(2)
    """,
    "norms/gate.py": """
        import torch.nn as nn


        class Gate(nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.proj = nn.Linear(dim, dim)

            def forward(self, x):
                return x * self.proj(x).sigmoid()
    """,
    "layers/__init__.py": "",
    "layers/mlp.py": """
        import torch.nn as nn


        class Mlp(nn.Module):
            def __init__(self, dim, hidden):
                super().__init__()
                from ..norms.act import SquaredReLU
                from ..norms.gate import Gate
                self.fc1 = nn.Linear(dim, hidden)
                self.act = SquaredReLU()
                self.gate = Gate(hidden)
                self.fc2 = nn.Linear(hidden, dim)

            def forward(self, x):
                return x + self.fc2(self.gate(self.act(self.fc1(x))))
    """,
    "net.py": """
        import torch.nn as nn

        from .layers.mlp import Mlp


        class Net(nn.Module):
            def __init__(self, dim=16, hidden=32):
                super().__init__()
                self.mlp = Mlp(dim, hidden)

            def forward(self, x):
                return self.mlp(x).pow(2).mean()
    """,
}


def test_a_relative_import_inside_a_mirrored_definition_names_the_installed_module_or_the_mirror(tmp_path):
    for name, text in LOCAL_IMPORT_PACKAGE.items():
        (tmp_path / "localpkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "localpkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    (tmp_path / "entry.py").write_text(textwrap.dedent(HELPER_ENTRY).replace("helperpkg.net", "localpkg.net")
                                       .lstrip("\n"))
    result = cli("entry.py", "--tp", "2", "-o", "out", cwd=tmp_path)     # its dry run builds the mirrors
    assert result.returncode == 0, result.stderr
    mlp = (tmp_path / "out" / "localpkg" / "layers" / "mlp.py").read_text()
    assert "from localpkg.norms.act import SquaredReLU" in mlp      # unchanged: the installed one
    assert "from ..norms.gate import Gate" in mlp                    # rewritten: its mirror
    assert not (tmp_path / "out" / "localpkg" / "norms" / "act.py").exists()
    assert "self.proj = nn.Linear(dim // 2, dim)" in (tmp_path / "out" / "localpkg" / "norms" / "gate.py").read_text()


# A mirrored class reading a module bound by a dotted import (`import collections.abc`, as
# transformers' CvtEmbeddings checks `isinstance(patch_size, collections.abc.Iterable)`): the
# mirror imports the bound name, `collections` (CvT TP=2's dry run failed with a NameError).
DOTTED_IMPORT_PACKAGE = {
    "__init__.py": "",
    "layers.py": """
        import collections.abc

        import torch.nn as nn


        class Mlp(nn.Module):
            def __init__(self, dim, hidden):
                super().__init__()
                sizes = hidden if isinstance(hidden, collections.abc.Iterable) else (hidden,)
                self.fc1 = nn.Linear(dim, sizes[0])
                self.fc2 = nn.Linear(sizes[0], dim)

            def forward(self, x):
                return self.fc2(self.fc1(x).relu())
    """,
    "net.py": """
        import torch.nn as nn

        from .layers import Mlp


        class Net(nn.Module):
            def __init__(self, dim=16, hidden=32):
                super().__init__()
                self.mlp = Mlp(dim, hidden)

            def forward(self, x):
                return (x + self.mlp(x)).pow(2).mean()
    """,
}


def test_a_mirror_imports_the_module_a_dotted_import_binds(tmp_path):
    (tmp_path / "dottedpkg").mkdir()
    for name, text in DOTTED_IMPORT_PACKAGE.items():
        (tmp_path / "dottedpkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    (tmp_path / "entry.py").write_text(textwrap.dedent(HELPER_ENTRY).replace("helperpkg.net", "dottedpkg.net")
                                       .lstrip("\n"))
    result = cli("entry.py", "--tp", "2", "-o", "out", cwd=tmp_path)     # its dry run builds the mirror
    assert result.returncode == 0, result.stderr
    layers = (tmp_path / "out" / "dottedpkg" / "layers.py").read_text()
    assert "from dottedpkg.layers import collections" in layers and "nn.Linear(dim, sizes[0] // 2)" in layers


# A layer looked up by its class in a table of another file, as timm's ConvNormAct passes its
# norm_layer to get_norm_act_layer, which checks `norm_layer in _NORM_ACT_TYPES`: the mirrored
# block names the rewritten class (its default argument), the registered builder (not defined
# again) the installed one; the library's lookup must find both.
LOOKUP_PACKAGE = {
    "__init__.py": "",
    "mlps.py": """
        import torch
        import torch.nn as nn


        class GatedMlp(nn.Module):
            def __init__(self, dim, hidden=32, gate=False):
                super().__init__()
                self.fc1 = nn.Linear(dim, hidden)
                self.fc2 = nn.Linear(hidden, dim)
                self.gate = gate

            def forward(self, x):
                h = self.fc1(x)
                return self.fc2(h * torch.sigmoid(h) if self.gate else torch.relu(h))


        class PlainMlp(nn.Module):
            def __init__(self, dim):
                super().__init__()
                self.fc = nn.Linear(dim, dim)

            def forward(self, x):
                return self.fc(x)
    """,
    "lookup.py": """
        import functools

        from .mlps import GatedMlp, PlainMlp

        _MLP_TYPES = {GatedMlp, PlainMlp}
        _MLP_ARGS = {GatedMlp: dict(gate=True)}


        def get_mlp_layer(layer):
            assert layer in _MLP_TYPES, f"no mlp layer for {layer.__name__}"
            return functools.partial(layer, **_MLP_ARGS.get(layer, {}))
    """,
    "net.py": """
        import torch.nn as nn

        from .lookup import get_mlp_layer
        from .mlps import GatedMlp


        def register(fn):
            return fn


        class Block(nn.Module):
            def __init__(self, dim, mlp_layer=GatedMlp):
                super().__init__()
                self.norm = nn.LayerNorm(dim)
                self.mlp = get_mlp_layer(mlp_layer)(dim)

            def forward(self, x):
                return x + self.mlp(self.norm(x))


        class Net(nn.Module):
            def __init__(self, dim=16, mlp_layer=None):
                super().__init__()
                self.blocks = nn.ModuleList([Block(dim), Block(dim, mlp_layer)])

            def forward(self, x):
                for block in self.blocks:
                    x = block(x)
                return x.pow(2).mean()


        @register
        def tiny():
            return Net(mlp_layer=GatedMlp)
    """,
}


def test_a_table_of_classes_holding_a_rewritten_class_holds_both_classes(tmp_path):
    for name, text in LOOKUP_PACKAGE.items():
        (tmp_path / "lookpkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "lookpkg" / name).write_text(textwrap.dedent(text).lstrip("\n"))
    entry = textwrap.dedent(HELPER_ENTRY).replace("from helperpkg.net import Net", "import lookpkg.net")
    (tmp_path / "entry.py").write_text(entry.replace("return Net()", "return lookpkg.net.tiny()").lstrip("\n"))
    result = cli("entry.py", "--tp", "2", "-o", "out", cwd=tmp_path)     # its dry run builds the mirrors
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "out" / "lookpkg" / "lookup.py").exists()    # the library's own lookup serves
    mlps = (tmp_path / "out" / "lookpkg" / "mlps.py").read_text()
    assert 'importlib.import_module("lookpkg.lookup")._MLP_TYPES.add(GatedMlp)' in mlps
    assert ('importlib.import_module("lookpkg.lookup")._MLP_ARGS[GatedMlp] = importlib.import_module('
            '"lookpkg.lookup")._MLP_ARGS[importlib.import_module("lookpkg.mlps").GatedMlp]') in mlps
    assert "PlainMlp" not in mlps.partition("import importlib")[2]          # unchanged: not registered
