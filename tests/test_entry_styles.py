"""Spec: the generated build() constructs the rewritten classes, however the entry file names them.

An entry file that builds a model from a package may reach its class by import (`from pkg import
Model`), as a module attribute (`pkg.Model`, `tf.models.llama.modeling_llama.LlamaForCausalLM`),
under an alias (`import Model as M`), through its own factory or registry, or through a library
factory (`AutoModelForCausalLM.from_config(config)`, a registry function of the package). In every
case each rank's build() must construct the rewritten, sharded classes of its own file: a build()
that constructs the library's class builds the full-size model on every rank, and loading the
shards into it fails.

The quick tests rewrite a tiny package of this module's own (tensor parallel, so every style is
checked against the shards) and transformers' Llama (data parallel, which plans in seconds: the
classes build() constructs are what is checked there). An entry file that would shadow a
rewritten class is refused at its `path:line:col`. The gloo runs (`verify` at TP=2) are marked slow.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nnscaler_cst.analysis import analyze
from nnscaler_cst.emit.output import write_output
from nnscaler_cst.errors import UserError
from nnscaler_cst.rewrite import PlanRequest, rewrite

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600
ERROR_LINE = re.compile(r"^(?P<where>[^\s:]+:\d+:\d+): error: (?P<message>.*)$")


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def position_of(text: str, needle: str) -> tuple[int, int]:
    """1-based (line, column) of `needle` in `text`, columns counted in characters."""
    offset = text.index(needle)
    before = text[:offset]
    return before.count("\n") + 1, offset - (before.rfind("\n") + 1) + 1


# ---- a tiny package: its model, a factory classmethod, a registry function -------------------------
LIBRARY = "styles_tinylib"
WIDTH, HIDDEN = 16, 32

LIBRARY_FILES = {
    "__init__.py": """
        from .modeling import TinyConfig, TinyMLP
        from .registry import AutoTiny, create
    """,
    "modeling.py": f"""
        import torch
        import torch.nn as nn


        class TinyConfig:
            def __init__(self, width={WIDTH}, hidden={HIDDEN}):
                self.width = width
                self.hidden = hidden


        class TinyBlock(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.up = nn.Linear(config.width, config.hidden)
                self.down = nn.Linear(config.hidden, config.width)

            def forward(self, x):
                return x + self.down(torch.relu(self.up(x)))


        class TinyMLP(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.block = TinyBlock(config)
                self.head = nn.Linear(config.width, 1)

            def forward(self, x):
                return self.head(self.block(x)).pow(2).mean()


        MODEL_FNS = {{}}


        def register_model(fn):
            if fn.__name__ in MODEL_FNS:
                raise RuntimeError(f"{{fn.__name__}} is registered already")
            MODEL_FNS[fn.__name__] = fn
            return fn


        def _tiny_mlp(config):
            return TinyMLP(config)


        @register_model
        def tiny_mlp(config=None):
            return _tiny_mlp(config or TinyConfig())
    """,
    "registry.py": """
        from . import modeling

        MODELS = {"mlp": "TinyMLP"}


        def create(kind, config):
            return getattr(modeling, MODELS[kind])(config)


        class AutoTiny:
            @classmethod
            def from_config(cls, config):
                return create("mlp", config)
    """,
}

def tiny_entry(head: str, build_body: str) -> str:
    """An entry file: imports and helpers (`head`), build(), example_inputs()."""
    return (f"import torch\n{dedent(head).strip()}\n\n\n"
            f"def build():\n{textwrap.indent(dedent(build_body).strip(), '    ')}\n\n\n"
            "def example_inputs():\n    return (torch.randn(8, 16),)\n")


# style -> (entry file text, whether build() names the class: no factory wrapper is needed)
TINY_STYLES = {
    "import": (tiny_entry(f"from {LIBRARY} import TinyConfig, TinyMLP\n", """
        return TinyMLP(TinyConfig())
    """), True),
    "module-attribute": (tiny_entry(f"import {LIBRARY}\n", f"""
        return {LIBRARY}.TinyMLP({LIBRARY}.TinyConfig())
    """), True),
    "alias": (tiny_entry(f"from {LIBRARY} import TinyConfig, TinyMLP as Model\n", """
        return Model(TinyConfig())
    """), True),
    "assigned-alias": (tiny_entry(f"import {LIBRARY}\n\nModel = {LIBRARY}.TinyMLP\n", f"""
        return Model({LIBRARY}.TinyConfig())
    """), True),
    "deep-module-attribute": (tiny_entry(f"import {LIBRARY} as lib\n", """
        return lib.modeling.TinyMLP(
            lib.TinyConfig(),
        )
    """), True),
    "own-factory": (tiny_entry(f"""
        from {LIBRARY} import modeling


        def make_model(config):
            model = modeling.TinyMLP(config)
            return model

    """, """
        return make_model(modeling.TinyConfig())
    """), True),
    "own-registry": (tiny_entry(f"""
        import {LIBRARY}

        REGISTRY = {{"mlp": {LIBRARY}.TinyMLP}}


        def make(kind, config):
            return REGISTRY[kind](config)

    """, f"""
        return make("mlp", {LIBRARY}.TinyConfig())
    """), False),
    "from-config": (tiny_entry(f"from {LIBRARY} import AutoTiny, TinyConfig\n", """
        return AutoTiny.from_config(TinyConfig())
    """), False),
    "registry-function": (tiny_entry(f"import {LIBRARY}\n", f"""
        return {LIBRARY}.create("mlp", {LIBRARY}.TinyConfig())
    """), False),
    # a decorated registry function (torchvision's resnet18) stays the installed one, and so
    # calls the installed helper constructing the class, although the helper is written anew
    "decorated-registry": (tiny_entry(f"from {LIBRARY}.modeling import tiny_mlp\n", """
        return tiny_mlp()
    """), False),
}


def stem(style: str) -> str:
    return "tiny_" + style.replace("-", "_")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """A folder holding the package, one entry file per style, and the outputs; importable."""
    root = tmp_path_factory.mktemp("entry_styles")
    (root / LIBRARY).mkdir()
    for name, text in LIBRARY_FILES.items():
        (root / LIBRARY / name).write_text(dedent(text))
    for style, (text, _) in TINY_STYLES.items():
        (root / f"{stem(style)}.py").write_text(text)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m.split(".")[0] in {LIBRARY, *(f"out_{stem(s)}" for s in TINY_STYLES)}]:
        del sys.modules[name]


def rewrite_in_process(entry: Path, out: Path, request: PlanRequest) -> Path:
    cwd = Path.cwd()
    os.chdir(entry.parent)          # labels in the output are relative to the working directory
    try:
        write_output(out, rewrite(analyze(entry), request).files)
    finally:
        os.chdir(cwd)
    return out


@pytest.fixture(scope="module")
def tiny_outputs(tiny_root):
    """style -> the output package of its entry file at --tp 2, imported."""
    made = {}

    def get(style: str):
        if style not in made:
            out = rewrite_in_process(tiny_root / f"{stem(style)}.py", tiny_root / f"out_{stem(style)}",
                                     PlanRequest(tp=2))
            made[style] = __import__(out.name)
        return made[style]
    return get


def entry_section(package) -> str:
    text = Path(package.rank_module(0).__file__).read_text()
    return text[text.index("# --- entry file "):]


@pytest.mark.slow
@pytest.mark.parametrize("style", list(TINY_STYLES))
def test_each_rank_builds_its_own_rewritten_and_sharded_classes(tiny_outputs, style):
    package = tiny_outputs(style)
    for rank in range(package.WORLD_SIZE):
        module = package.rank_module(rank)
        model = package.build(rank)
        assert type(model) is module.TinyMLP and type(model.block) is module.TinyBlock, style
        assert model.block.up.weight.shape == (HIDDEN // 2, WIDTH)       # split over the 2 ranks
        assert model.block.down.weight.shape == (WIDTH, HIDDEN // 2)


@pytest.mark.slow
@pytest.mark.parametrize("style", list(TINY_STYLES))
def test_the_shards_of_the_single_device_model_load_into_each_rank(tiny_outputs, style):
    package = tiny_outputs(style)
    library = sys.modules[f"{LIBRARY}.modeling"]
    full = library.TinyMLP(library.TinyConfig()).state_dict()
    for rank in range(package.WORLD_SIZE):
        package.build(rank).load_state_dict(package.shard_state_dict(full, rank), strict=True)


@pytest.mark.parametrize("style", list(TINY_STYLES))
def test_the_library_class_is_left_as_it_was(tiny_outputs, style):
    package = tiny_outputs(style)
    library, registry = sys.modules[f"{LIBRARY}.modeling"], sys.modules[f"{LIBRARY}.registry"]
    init = vars(library.TinyMLP)["__init__"]
    package.build(0)
    assert vars(library.TinyMLP)["__init__"] is init
    model = registry.AutoTiny.from_config(library.TinyConfig())
    assert type(model) is library.TinyMLP and model.block.up.weight.shape == (HIDDEN, WIDTH)


@pytest.mark.parametrize("style", [s for s, (_, named) in TINY_STYLES.items() if named])
def test_a_build_that_names_the_class_calls_the_rewritten_class_itself(tiny_outputs, style):
    section = entry_section(tiny_outputs(style))
    assert "_constructing_rewritten" not in section
    assert LIBRARY not in section           # the import of the package went with its last use
    assert re.search(r"\bTinyMLP\((TinyConfig\(\)|config|\n)", section), section


def test_the_import_style_keeps_the_entry_code_as_written(tiny_outputs):
    """The style that always worked: the import of the rewritten names goes, the rest is the file."""
    text, _ = TINY_STYLES["import"]
    expected = text.replace(f"import torch\nfrom {LIBRARY} import TinyConfig, TinyMLP\n", "")
    section = entry_section(tiny_outputs("import"))
    assert section.split("\n", 1)[1] == expected


def test_an_alias_and_a_module_attribute_name_the_rewritten_class_and_lose_their_import(tiny_outputs):
    alias = entry_section(tiny_outputs("alias"))
    assert "return TinyMLP(TinyConfig())" in alias and "Model" not in alias and "import" not in alias
    deep = entry_section(tiny_outputs("deep-module-attribute"))
    assert "return TinyMLP(\n        TinyConfig(),\n    )" in deep and "lib" not in deep


# the entry file's call on the way to the class's construction, named in the wrapper's comment
FACTORY_CALLS = {"own-registry": "REGISTRY[kind](config)", "from-config": "AutoTiny.from_config(",
                 "registry-function": f"{LIBRARY}.create(", "decorated-registry": "tiny_mlp()"}


@pytest.mark.parametrize("style", [s for s, (_, named) in TINY_STYLES.items() if not named])
def test_a_factory_build_is_wrapped_with_the_library_class_mapped_to_the_rewritten_one(tiny_outputs, style):
    section = entry_section(tiny_outputs(style))
    line, col = position_of(TINY_STYLES[style][0], FACTORY_CALLS[style])
    comment = " ".join(line.removeprefix("# ") for line in section.splitlines() if line.startswith("# "))
    assert f"by a call that does not name the class ({stem(style)}.py:{line}:{col}: a factory" in comment, comment
    assert f"from {LIBRARY}.modeling import TinyMLP as _library_TinyMLP\n" in section
    last = section.rstrip("\n").rpartition("\n")[2]
    assert last.startswith("build = _constructing_rewritten(build, {") and "_library_TinyMLP: TinyMLP" in last, last


def test_a_decorated_registry_function_builds_the_rewritten_classes(tiny_outputs):
    """The output imports the decorated function rather than registering it again; what it calls is
    the installed code, so build() must turn the installed class into the rewritten one."""
    package = tiny_outputs("decorated-registry")
    assert "from styles_tinylib.modeling import tiny_mlp  # decorated" in Path(package.rank_module(0).__file__).read_text()
    model = package.build(0)
    assert type(model) is package.rank_module(0).TinyMLP
    assert model.block.up.weight.shape == (HIDDEN // 2, WIDTH)


def test_the_dry_run_refuses_a_build_of_the_installed_classes(tiny_root, monkeypatch):
    """Were build() left constructing the installed class (the decorated function's route taken for
    the rewritten code), the dry run says so: every rank would run the single-device layers."""
    import nnscaler_cst.rewrite as rewriting
    monkeypatch.setattr(rewriting, "built_by_code_kept", lambda *given: lambda construction: True)
    with pytest.raises(UserError, match="build\\(\\) made the model of the installed styles_tinylib.modeling.TinyMLP"):
        rewrite(analyze(tiny_root / f"{stem('decorated-registry')}.py"), PlanRequest(tp=2))


@pytest.mark.slow
def test_the_output_is_the_same_for_the_same_entry(tiny_root, tiny_outputs):
    first = tiny_root / f"out_{stem('from-config')}"
    tiny_outputs("from-config")
    second = rewrite_in_process(tiny_root / f"{stem('from-config')}.py", tiny_root / "again", PlanRequest(tp=2))
    for path in sorted(first.glob("*.py")):
        assert (second / path.name).read_text() == path.read_text(), path.name


def test_no_generated_file_imports_the_tool(tiny_outputs):
    for style in ("from-config", "module-attribute"):
        folder = Path(tiny_outputs(style).__file__).parent
        for path in folder.glob("*.py"):
            tree = ast.parse(path.read_text())
            modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            assert not [m for m in modules if m.split(".")[0] == "nnscaler_cst"], path


# ---- a conv net with BatchNorm behind a decorated registry function (torchvision's resnet18) --------
CONV_LIBRARY = {
    "__init__.py": "",
    "models.py": """
        import torch
        import torch.nn as nn

        MODELS = {}


        def register_model(fn):
            if fn.__name__ in MODELS:
                raise RuntimeError(f"{fn.__name__} is registered already")
            MODELS[fn.__name__] = fn
            return fn


        class ConvNet(nn.Module):
            def __init__(self, width=8, num_classes=4):
                super().__init__()
                self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
                self.bn1 = nn.BatchNorm2d(width)
                self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
                self.bn2 = nn.BatchNorm2d(width)
                self.fc = nn.Linear(width, num_classes)

            def forward(self, x):
                x = torch.relu(self.bn1(self.conv1(x)))
                x = torch.relu(self.bn2(self.conv2(x)))
                return self.fc(torch.flatten(x.mean((2, 3)), 1))


        def _convnet(**kwargs):
            return ConvNet(**kwargs)


        @register_model
        def convnet(**kwargs):
            return _convnet(**kwargs)
    """,
}

CONV_ENTRY = """
    import torch
    from styles_convlib.models import convnet


    def build():
        torch.manual_seed(0)
        return convnet()


    def example_inputs():
        return (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


    def loss(output):
        return output.pow(2).mean()
"""


@pytest.mark.slow
def test_a_conv_net_built_by_a_decorated_registry_function_verifies_split(tmp_path):
    """Before, every rank ran the installed, whole ConvNet: the split plan failed its dry run and
    the channels stayed whole (a batch-split conv's summed partial gradient doubled resnet18's)."""
    (tmp_path / "styles_convlib").mkdir()
    for name, text in CONV_LIBRARY.items():
        (tmp_path / "styles_convlib" / name).write_text(dedent(text))
    (tmp_path / "entry.py").write_text(dedent(CONV_ENTRY))
    result = cli("verify", "entry.py", "--tp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    assert "stays whole" not in result.stdout + result.stderr
    assert "self.conv1 = nn.Conv2d(3, width // 2" in (tmp_path / "out" / "model.py").read_text()


# ---- entry files the rewrite must refuse ---------------------------------------------------------
# id -> (entry text, the text the error points at, words the message must hold)
BAD_ENTRIES = {
    "defines-a-rewritten-name": (tiny_entry(f"""
        from {LIBRARY} import TinyConfig, TinyMLP


        class TinyBlock(torch.nn.Module):
            pass

    """, "return TinyMLP(TinyConfig())"), "TinyBlock(torch", ["`TinyBlock`", "replace the rewritten"]),
    "imports-another-object-as-a-rewritten-name": (tiny_entry(f"""
        from torch.nn import Linear as TinyBlock
        from {LIBRARY} import TinyConfig, TinyMLP
    """, "return TinyMLP(TinyConfig())"), "Linear as TinyBlock", ["`TinyBlock`", "replace the rewritten"]),
    "local-variable-named-like-the-class": (tiny_entry(f"import {LIBRARY}\n", f"""
        TinyMLP = None
        return {LIBRARY}.TinyMLP({LIBRARY}.TinyConfig())
    """), f"{LIBRARY}.TinyMLP(", ["`TinyMLP`", "local variable"]),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Each bad entry rewritten by the real command line, two at a time."""
    root = tmp_path_factory.mktemp("bad_entries")
    (root / LIBRARY).mkdir()
    for name, text in LIBRARY_FILES.items():
        (root / LIBRARY / name).write_text(dedent(text))

    def run(case: str):
        folder = root / case
        folder.mkdir()
        (folder / "model.py").write_text(BAD_ENTRIES[case][0])
        env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(
            filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "model.py", "--tp", "2", "-o", "out"],
                                cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        return folder, result

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(BAD_ENTRIES, pool.map(run, BAD_ENTRIES)))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_ENTRIES))
def test_an_entry_that_would_shadow_the_rewritten_code_is_refused_at_its_place(refusals, case):
    folder, result = refusals[case]
    text, at, says = BAD_ENTRIES[case]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    match = ERROR_LINE.match(lines[0])
    assert match, result.stderr
    line, col = position_of(text, at)
    assert match["where"] == f"model.py:{line}:{col}", result.stderr
    flat = " ".join(result.stderr.split())
    assert all(words in flat for words in says), result.stderr
    assert len(lines) == 2 and lines[1].startswith("  hint: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not (folder / "out").exists()


# ---- transformers' Llama, by every route -----------------------------------------------------------
LLAMA_CONFIG = """LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )"""


def llama_entry(head: str, build: str, config: str = LLAMA_CONFIG) -> str:
    return (f'"""Entry file: transformers\' Llama at a tiny config."""\nimport torch\n{head}\n\n\n'
            f"def build():\n    config = {config}\n    return {build}\n\n\n"
            "def example_inputs():\n    input_ids = torch.randint(0, 256, (4, 16))\n"
            '    return {"input_ids": input_ids, "labels": input_ids}\n')


LLAMA_STYLES = {
    "module-attribute": llama_entry("import transformers", "transformers.LlamaForCausalLM(config)",
                                    "transformers." + LLAMA_CONFIG),
    "alias": llama_entry("from transformers import LlamaConfig, LlamaForCausalLM as L", "L(config)"),
    "deep-module-attribute": llama_entry("import transformers as tf\nfrom transformers import LlamaConfig",
                                         "tf.models.llama.modeling_llama.LlamaForCausalLM(config)"),
    "from-config": llama_entry("from transformers import AutoModelForCausalLM, LlamaConfig",
                               "AutoModelForCausalLM.from_config(config)"),
}


@pytest.fixture(scope="module")
def llama_outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_styles")
    sys.path.insert(0, str(root))
    made = {}

    def get(style: str):
        if style not in made:
            name = "llama_" + style.replace("-", "_")
            (root / f"{name}.py").write_text(LLAMA_STYLES[style])
            out = rewrite_in_process(root / f"{name}.py", root / f"out_{name}", PlanRequest(dp=2))
            made[style] = __import__(out.name)
        return made[style]
    yield get
    sys.path.remove(str(root))


@pytest.mark.slow
@pytest.mark.parametrize("style", list(LLAMA_STYLES))
def test_llama_by_any_route_builds_the_classes_of_the_rank_file(llama_outputs, style):
    import transformers.models.llama.modeling_llama as library
    package = llama_outputs(style)
    module = package.rank_module(0)
    model = package.build(0)
    assert type(model) is module.LlamaForCausalLM, type(model)
    from_library = {name for name, m in model.named_modules() if type(m).__module__ == library.__name__}
    assert not from_library, sorted(from_library)
    assert type(model.model.layers[0].self_attn) is module.LlamaAttention
    assert vars(library.LlamaForCausalLM)["__init__"].__qualname__ == "LlamaForCausalLM.__init__"   # put back


# ---- proven on gloo ---------------------------------------------------------------------------------
BERT_MODULE_ATTRIBUTE = dedent('''
    """The entry of issue 8: transformers' BERT reached as a module attribute."""
    import torch
    import transformers


    def build():
        config = transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, max_position_embeddings=64)
        return transformers.BertForMaskedLM(config)


    def example_inputs():
        ids = torch.randint(0, 256, (4, 16))
        return {"input_ids": ids, "labels": ids}
''')

SLOW_CASES = {
    "bert-module-attribute": BERT_MODULE_ATTRIBUTE,
    "llama-module-attribute": LLAMA_STYLES["module-attribute"],
    "llama-from-config": LLAMA_STYLES["from-config"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES))
def test_each_style_trains_like_the_single_device_run_at_tp2(tmp_path, case):
    (tmp_path / "model.py").write_text(SLOW_CASES[case])
    result = cli("verify", "model.py", "--tp", "2", "-o", "parallel", "--json", cwd=tmp_path)
    start = result.stdout.find("{")
    assert start >= 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    outcome = json.loads(result.stdout[start:])
    assert result.returncode == 0 and outcome["passed"] is True, outcome
    assert outcome["world_size"] == 2
    assert outcome["max_abs_error"] <= outcome["tolerance"]["param_atol"], outcome["worst_param"]
    text = (tmp_path / "parallel" / "model.py").read_text()
    entry = text[text.index("# --- entry file "):]
    assert "transformers.BertForMaskedLM" not in entry and "transformers.LlamaForCausalLM" not in entry


@pytest.mark.slow
def test_an_entry_importing_its_model_from_a_sibling_file_verifies_at_dp2(tmp_path):
    """verify's single-device run imports the entry the way the user runs it: with its own
    folder on sys.path, so `from blocks import Net` finds the sibling (found by the fuzzer)."""
    (tmp_path / "blocks.py").write_text(dedent("""
        import torch.nn as nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)

            def forward(self, x):
                return self.fc(x).relu().mean()
        """))
    (tmp_path / "model.py").write_text(dedent("""
        import torch
        from blocks import Net

        def build():
            return Net()

        def example_inputs():
            return (torch.randn(4, 16),)
        """))
    result = cli("verify", "model.py", "--dp", "2", "-o", "parallel", "--json", cwd=tmp_path)
    start = result.stdout.find("{")
    assert start >= 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 and json.loads(result.stdout[start:])["passed"] is True


@pytest.mark.slow
@pytest.mark.parametrize("plan", [["--pp", "2"], ["--dp", "2", "--recompute"]])
def test_a_block_loop_in_the_entry_around_blocks_from_a_sibling_file_is_cut_and_verifies(tmp_path, plan):
    """Block in a second file, the model with its loop in the entry (a common layout; the fuzzer
    drew it): the pipeline cuts, and --recompute checkpoints, the entry's loop. Both were refused
    before ('the loop over the blocks is not in the model's main file')."""
    (tmp_path / "blocks.py").write_text(dedent("""
        import torch.nn as nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)

            def forward(self, x):
                return x + self.fc(x).tanh()
        """))
    (tmp_path / "model.py").write_text(dedent("""
        import torch
        import torch.nn as nn
        from blocks import Block

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(8, 16)
                self.blocks = nn.ModuleList([Block() for _ in range(4)])

            def forward(self, x):
                x = self.embed(x)
                for block in self.blocks:
                    x = block(x)
                return x.square().mean()

        def build():
            return Net()

        def example_inputs():
            return (torch.randn(4, 8),)
        """))
    result = cli("verify", "model.py", *plan, "-o", "parallel", "--json", cwd=tmp_path)
    start = result.stdout.find("{")
    assert start >= 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 and json.loads(result.stdout[start:])["passed"] is True
    written = (tmp_path / "parallel" / ("model_stage1.py" if "--pp" in plan else "model.py")).read_text()
    net = written[written.index("class Net"):]
    assert ("x, = pp_receive()" if "--pp" in plan else "checkpoint(") in net, net


@pytest.mark.slow
def test_an_entry_with_its_own_classes_around_sibling_blocks_is_rewritten_whole(tmp_path):
    """Blocks in a sibling file, the model around them in the entry: both files' classes are
    rewritten (the dry run before writing loads each rank's shards into its model, so a
    constructor left at full size fails the run), also when the entry is given from another
    folder (found by the fuzzer)."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "blocks.py").write_text(dedent("""
        import torch.nn as nn
        import torch.nn.functional as F

        class Block(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.up = nn.Linear(width, 4 * width)
                self.down = nn.Linear(4 * width, width)

            def forward(self, x):
                return x + self.down(F.gelu(self.up(x)))
        """))
    (folder / "model.py").write_text(dedent("""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from blocks import Block

        class Model(nn.Module):
            def __init__(self, vocab=64, width=32):
                super().__init__()
                self.tok = nn.Embedding(vocab, width)
                self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
                self.head = nn.Linear(width, vocab)

            def forward(self, ids, targets):
                h = self.tok(ids)
                for block in self.blocks:
                    h = block(h)
                return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

        def build():
            return Model()

        def example_inputs():
            return {"ids": torch.randint(0, 64, (2, 8)), "targets": torch.randint(0, 64, (2, 8))}
        """))
    result = cli("project/model.py", "--tp", "2", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    split = {name for name, layout in plan["params"].items() if layout["tp"].startswith("S")}
    assert {"head.weight", "blocks.0.up.weight"} <= split, split   # an entry class and a sibling's, both split
