"""Activation recompute per block (`--recompute`, issue 9): the emitted model runs every repeated
block under torch.utils.checkpoint at the call in the loop over the blocks, composes with
tensor, data and pipeline parallelism (gloo verifies, slow), and keeps less between forward
and backward: measured on CPU, in process, against bounds derived from the model's sizes.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import import_output
from nnscaler_cst.analysis import analyze
from nnscaler_cst.plan.recompute import block_activations
from nnscaler_cst.rewrite import PlanRequest, rewrite

REPO = Path(__file__).resolve().parents[1]
GPT = REPO / "fixtures" / "gpt.py"
TIMEOUT_S = 600
ERROR_LINE = re.compile(r"^(?P<path>[^\s:]+):(?P<line>\d+):(?P<col>\d+): error: ")

# the GPT fixture's sizes (fixtures/gpt.py: GPTConfig and example_inputs)
B, T, C, HEADS, LAYERS = 8, 16, 64, 4, 4
FLOAT = 4


def run_cli(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def model_source(files: dict[str, str]) -> str:
    return next(text for name, text in sorted(files.items()) if name.startswith("model") and name.endswith(".py"))


@pytest.fixture(scope="module")
def gpt():
    return analyze(GPT)


@pytest.mark.slow
def test_each_block_runs_under_checkpoint_where_the_loop_calls_it(gpt):
    text = model_source(rewrite(gpt, PlanRequest(tp=2, recompute=True)).files)
    assert "        for block in self.transformer.h:\n            x = torch.utils.checkpoint.checkpoint(block, x, " \
           "use_reentrant=False)  # recompute: the block keeps only its inputs; backward reruns its forward\n" in text
    assert text.count("torch.utils.checkpoint") == 1
    assert "tp_reduce(" in text        # tensor parallel inside the blocks is untouched


def test_without_recompute_nothing_is_checkpointed(gpt):
    assert "checkpoint" not in model_source(rewrite(gpt, PlanRequest(tp=2)).files)


@pytest.mark.slow
def test_the_plan_names_recompute(gpt):
    result = rewrite(gpt, PlanRequest(tp=2, recompute=True))
    plain = rewrite(gpt, PlanRequest(tp=2))
    assert result.plan.describe() == "megatron+recompute tp=2 dp=1 pp=1"
    assert result.plan.estimated_step_seconds > plain.plan.estimated_step_seconds   # forwards run twice


def test_a_call_written_one_argument_per_line_keeps_its_layout(tmp_path):
    model = tmp_path / "blocks.py"
    model.write_text(textwrap.dedent('''\
        import torch
        import torch.nn as nn


        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x, scale=1.0):
                return x + scale * torch.tanh(self.fc(x))


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(3)])

            def forward(self, x):
                for block in self.blocks:
                    x = block(
                        x,
                        scale=0.5,
                    )
                return x.sum()


        def build():
            return Net()


        def example_inputs():
            return (torch.randn(4, 8),)
        '''))
    text = model_source(rewrite(analyze(model), PlanRequest(recompute=True)).files)
    assert textwrap.dedent('''\
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(
                    block,
                    x,
                    scale=0.5,
                    use_reentrant=False,
                )  # recompute: the block keeps only its inputs; backward reruns its forward
        ''') in textwrap.dedent(text[text.index("        for block"):text.index("        return x.sum()")])


def test_block_activations_read_from_the_traced_sizes(gpt):
    found = block_activations(gpt.graph)
    assert (found.container, found.blocks) == ("transformer.h", LAYERS)
    assert found.kept(recompute=True) == found.inputs == B * T * C * FLOAT     # the hidden state handed in
    # at least what autograd must keep: attention probabilities, the MLP's 4C hidden before and after GELU
    assert found.kept(recompute=False) == found.saved >= (B * HEADS * T * T + 2 * 4 * B * T * C) * FLOAT
    assert found.rebuilt == found.saved


@pytest.mark.slow
def test_recompute_on_a_model_without_repeated_blocks_is_refused_at_its_place(tmp_path):
    out = tmp_path / "out"
    result = run_cli(REPO / "fixtures" / "mlp.py", "--tp", 2, "--recompute", "-o", out)
    assert result.returncode == 2, result.stdout + result.stderr
    first = result.stderr.strip().splitlines()[0]
    assert ERROR_LINE.match(first) and "--recompute" in first, result.stderr
    assert "hint:" in result.stderr
    assert not out.exists()


# ---- memory, measured on CPU in this process -------------------------------------------------------

class AliveBytes(TorchDispatchMode):
    """Bytes of the storages torch ops made that are still alive: after a forward, what the
    model holds for its backward (saved tensors and the checkpoints' inputs alike). Parameters,
    buffers and the batch are excluded; views share their base's storage and count once."""

    def __init__(self, excluded: set[int]):
        super().__init__()
        self.excluded = excluded
        self.alive = 0
        self.tracked: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.tracked.discard(key)
        self.alive -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)     # the storage's Python object lives exactly as long as the storage
                if key not in self.tracked and storage.data_ptr() not in self.excluded:
                    self.tracked.add(key)
                    self.alive += storage.nbytes()
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def held_after_forward(folder: Path) -> tuple[int, list[int]]:
    """(bytes alive after the forward, bytes each block's forward left alive) of the output's rank 0."""
    package = import_output(folder)
    module = package.rank_module(0)
    torch.manual_seed(0)
    model = package.build(0)
    model.train()
    batch = module.example_inputs()
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *batch]}
    meter = AliveBytes(excluded)
    per_block: list[int] = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda m, args: setattr(m, "_alive_before", meter.alive))
        block.register_forward_hook(lambda m, args, out: per_block.append(meter.alive - m._alive_before))
    with meter:
        loss = model(*batch)
    held = meter.alive
    forwards = per_block[:]
    loss.backward()                       # the recomputed forwards run here; they must train
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return held, forwards


@pytest.mark.slow
def test_recompute_keeps_only_each_blocks_input_between_forward_and_backward(tmp_path, gpt):
    for name, options in (("gpt_plain", []), ("gpt_recompute", ["--recompute"])):
        result = run_cli(GPT, *options, "-o", tmp_path / name)
        assert result.returncode == 0, result.stdout + result.stderr
    plain, plain_blocks = held_after_forward(tmp_path / "gpt_plain")
    kept, kept_blocks = held_after_forward(tmp_path / "gpt_recompute")
    hidden = B * T * C * FLOAT
    # with recompute a block leaves exactly its output alive, the next block's kept input
    assert kept_blocks == [hidden] * LAYERS
    # without, at least the attention probabilities and the MLP's hidden before and after GELU
    floor = (B * HEADS * T * T + 2 * 4 * B * T * C) * FLOAT
    assert len(set(plain_blocks)) == 1 and plain_blocks[0] >= floor, plain_blocks
    # the rest of the model (embeddings, final norm, head, loss) holds the same either way
    assert plain - kept == LAYERS * (plain_blocks[0] - hidden)
    assert plain - kept >= LAYERS * (floor - hidden)
    # block_activations (the memory model's figure) bounds the measurement from above
    estimate = block_activations(gpt.graph)
    assert estimate.kept(recompute=True) == kept_blocks[0]
    assert plain_blocks[0] <= estimate.kept(recompute=False) <= 1.6 * plain_blocks[0]


NORMED_BLOCKS = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


class Model(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.inp = nn.Conv2d(3, c, 1)
        self.blocks = nn.ModuleList(Block(c) for _ in range(2))
        self.out = nn.Linear(c, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x.mean((2, 3))).pow(2).mean()


def build():
    torch.manual_seed(0)
    return Model()


def example_inputs():
    return (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)
"""


@pytest.mark.slow
def test_a_blocks_batch_norm_statistics_change_once_a_forward_under_recompute(tmp_path):
    """Backward's second forward of a block would update BatchNorm's running statistics (and its
    count of batches) again: the output puts them back as the forward left them, so they end each
    step as the single-device run's (verify compares them after the last step)."""
    (tmp_path / "model.py").write_text(NORMED_BLOCKS)
    result = run_cli("verify", "model.py", "--dp", 2, "--recompute", "-o", "out", cwd=tmp_path)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout + result.stderr
    assert "context_fn=buffers_kept_through_recompute(block, ('norm.num_batches_tracked', 'norm.running_mean', " \
           "'norm.running_var'))" in (tmp_path / "out" / "model.py").read_text()


# ---- equivalence on gloo ---------------------------------------------------------------------------

RUNS = {
    "gpt-tp2": ("gpt.py", ["--tp", 2]),
    "gpt-dp2": ("gpt.py", ["--dp", 2]),
    "gpt-pp2": ("gpt.py", ["--pp", 2, "--micro-batches", 4]),
    "hf_llama-tp2": ("hf_llama.py", ["--tp", 2]),
}


@pytest.fixture(scope="module")
def verified(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("recompute_verify")

    def one(name: str) -> dict:
        fixture, options = RUNS[name]
        result = run_cli("verify", f"fixtures/{fixture}", *options, "--recompute", "-o", root / name.replace("-", "_"),
                         "--json", "--steps", 2)
        assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return {"outcome": json.loads(result.stdout), "folder": root / name.replace("-", "_")}

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(RUNS, pool.map(one, RUNS)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_recompute_trains_like_the_single_device_model(verified, name):
    run = verified[name]
    assert run["outcome"]["passed"], run["outcome"]
    sources = [p.read_text() for p in run["folder"].glob("model*.py")]
    assert sources and all("torch.utils.checkpoint.checkpoint(" in s and "use_reentrant=False" in s for s in sources)


CROSS_ATTENDING = """
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.q, self.kv, self.out = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)

    def forward(self, x, context):
        # every block reads the same context, as a decoder's blocks read the encoder's output
        return x + self.out(torch.tanh(self.q(x) * self.kv(context)))


class Model(nn.Module):
    def __init__(self, c=16, layers=3):
        super().__init__()
        self.embed, self.encode = nn.Linear(c, c), nn.Linear(c, c)
        self.blocks = nn.ModuleList(Block(c) for _ in range(layers))

    def forward(self, x, source):
        x, context = self.embed(x), self.encode(source)
        for block in self.blocks:
            x = block(x, context)
        return x.pow(2).mean()


def build():
    return Model()


def example_inputs():
    return torch.randn(4, 8, 16), torch.randn(4, 8, 16)
"""


def test_a_tensor_every_block_reads_is_kept_once_under_recompute(tmp_path):
    # T5's decoder blocks all read the encoder's output: a checkpoint per block keeps a reference
    # to it, not a copy, so the memory model counts it once (it was counted per block: T5-3B's
    # recompute rows rose 0.2 GiB when the decoder became the representative list)
    (tmp_path / "model.py").write_text(CROSS_ATTENDING)
    analysis = analyze(tmp_path / "model.py")
    found = block_activations(analysis.graph)
    hidden = 4 * 8 * 16 * FLOAT
    assert (found.inputs, found.shared_inputs) == (hidden, hidden)
    # measured: the loop of checkpointed blocks leaves one hidden state per block alive
    namespace: dict = {}
    exec(compile(CROSS_ATTENDING, str(tmp_path / "model.py"), "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["Model"]()
    x, source = namespace["example_inputs"]()
    x, context = model.embed(x), model.encode(source)
    meter = AliveBytes({t.untyped_storage().data_ptr() for t in [*model.parameters(), x, context]})
    with meter:
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, context, use_reentrant=False)
    assert meter.alive == len(model.blocks) * found.inputs
