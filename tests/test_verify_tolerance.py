"""verify's gradient check: relative to each tensor's scale and to the gradients' overall scale;
and what both runs switch off so that they can agree at all (randomness a batch split redraws)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nnscaler_cst.verify.equivalence import (VerifyResult, derived_tolerance, gradient_error, noise_driven,
                                             nothing_to_compare, rounding_of)


def test_rounding_noise_on_a_zero_true_gradient_is_no_error():
    """A key bias's true gradient is zero (softmax ignores a per-query constant): both runs
    give rounding noise there, which differs by 100% of itself."""
    expected = {"attn.k.bias": torch.full((8,), 3e-9), "attn.q.weight": torch.randn(8, 8)}
    merged = {"attn.k.bias": torch.full((8,), -2e-9), "attn.q.weight": expected["attn.q.weight"].clone()}
    error, _ = gradient_error(expected, merged)
    assert error < 1e-3


def test_a_wrong_gradient_is_an_error_whatever_its_scale():
    torch.manual_seed(0)
    expected = {"v.weight": torch.randn(8, 8) * 1e-2, "q.weight": torch.randn(8, 8)}
    merged = {"v.weight": expected["v.weight"] * 0.08, "q.weight": expected["q.weight"].clone()}   # 92% off
    error, name = gradient_error(expected, merged)
    assert name == "v.weight" and error > 0.5


def _bias_before_a_norm():
    """A linear layer over the tokens, then a LayerNorm over the features: the layer's bias adds a
    constant along the normalised dim, so its exact gradient is zero; in float32 it is rounding of
    a sum of terms that cancel (3e-5 here, beside gradients of 0.08: past the floor of 1e-3 of the
    largest gradient, which alone would call the parallel run's different rounding an error)."""
    torch.manual_seed(0)
    mix, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(9)
    head = torch.nn.Linear(9, 9)
    x = torch.randn(4, 8, 9) * 1e-2      # small features: the norm scales its input gradients up 100x

    def grads(dtype):
        layers = [m.to(dtype) for m in (mix, norm, head)]
        for layer in layers:
            layer.zero_grad()
        out = layers[2](layers[1](layers[0](x.to(dtype).transpose(1, 2)).transpose(1, 2)))
        out.pow(2).mean().backward()
        return {"mix.bias": mix.bias.grad.clone(), "mix.weight": mix.weight.grad.clone(),
                "head.weight": head.weight.grad.clone()}
    return grads(torch.float64), {k: v.float() for k, v in grads(torch.float32).items()}


def test_a_gradient_that_is_rounding_in_float64_terms_is_judged_by_that_rounding():
    exact, expected = _bias_before_a_norm()
    assert exact["mix.bias"].abs().max() < 1e-12 < expected["mix.bias"].abs().max()
    # the parallel run's rounding differs: a difference as large as the float32 gradient itself
    merged = {k: v.clone() for k, v in expected.items()}
    merged["mix.bias"] = -expected["mix.bias"]
    rounding = rounding_of(expected, exact)
    assert noise_driven(expected, exact, rounding) == ["mix.bias"]
    assert gradient_error(expected, merged)[0] > 0.1            # judged by scale alone: an error
    error, _ = gradient_error(expected, merged, rounding)
    assert error < 1e-3
    # a real error on a gradient that is not rounding still fails, the yardstick given or not
    merged["mix.weight"] = expected["mix.weight"] * 0.9
    assert gradient_error(expected, merged, rounding)[0] > 0.05
    assert gradient_error(expected, merged, rounding)[1] == "mix.weight"


def test_a_reference_whose_one_summation_order_lands_next_to_float64_is_judged_by_another_order():
    """RegNet's grouped conv through BatchNorm (transformers' regnet, coverage sweep): the float32
    reference with one thread was 1e-4 from float64 on that conv's gradient, with two threads
    0.6%, and the tensor-parallel run's own order 3.6%: verify called it wrong. Here: a float32
    gradient 1e-6 from float64, the same step summed in another order 2% away, a parallel run 3%
    away: rounding, not an error; 50% away still is one."""
    torch.manual_seed(0)
    exact = {"conv.weight": torch.randn(8, 8, dtype=torch.float64)}
    expected = {"conv.weight": (exact["conv.weight"] + 1e-6).float()}
    reordered = {"conv.weight": (exact["conv.weight"] * 1.02).float()}
    merged = {"conv.weight": expected["conv.weight"] * 1.03}
    tolerance = 1e-3        # verify's grad_rtol
    assert gradient_error(expected, merged, rounding_of(expected, exact))[0] > tolerance
    assert gradient_error(expected, merged, rounding_of(expected, exact, reordered))[0] < tolerance
    merged = {"conv.weight": expected["conv.weight"] * 1.5}
    assert gradient_error(expected, merged, rounding_of(expected, exact, reordered))[0] > tolerance
    empty = {"none": torch.zeros(0)}            # MobileBERT has a parameter with no elements
    assert rounding_of(empty, {"none": torch.zeros(0, dtype=torch.float64)}, empty) == {}


FLOAT32 = {"param_atol": 5e-4, "loss_atol": 1e-4, "rtol": 1e-4, "grad_rtol": 1e-3}   # verify's defaults


def _bfloat16_gradients():
    """A small MLP built in bfloat16 (as torchtitan's gpt_oss is swept): its first gradients on the
    whole batch, and as data parallelism makes them, the mean of two halves' gradients, each
    rounded to bfloat16 and summed in it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    x = torch.randn(8, 8, 16, dtype=torch.bfloat16)

    def grads(batch):
        model.zero_grad()
        model(batch).float().pow(2).mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}
    whole, first, second = grads(x), grads(x[:4]), grads(x[4:])
    return whole, {name: (first[name] + second[name]) / 2 for name in whole}


def test_a_bfloat16_models_rounding_is_judged_by_bfloat16s_tolerances_and_a_wrong_gradient_still_fails():
    """gpt_oss built in bfloat16 was called wrong at DP=2 by float32's tolerances: its gradients
    0.7% apart (about 2**-8, bfloat16's rounding), its parameters 4e-3 (a unit in bfloat16's last
    place). The tolerances follow the dtype the reference's parameters are held in; a doubled
    bias gradient (a tp_copy too many) is still an error."""
    whole, data_parallel = _bfloat16_gradients()
    precision, tolerance = derived_tolerance(FLOAT32, None, whole, steps=3, lr=1e-3)
    assert precision == "bf16"
    error, _ = gradient_error(whole, data_parallel)
    assert FLOAT32["grad_rtol"] < error <= tolerance["grad_rtol"]
    wrong = {**data_parallel, "2.bias": 2 * data_parallel["2.bias"]}
    assert gradient_error(whole, wrong) == (pytest.approx(1.0, abs=0.05), "2.bias")
    assert gradient_error(whole, wrong)[0] > tolerance["grad_rtol"]
    # parameters stored in bfloat16 round each AdamW step (lr 1e-3) to their dtype: 4·lr·K
    assert tolerance["param_atol"] == pytest.approx(4 * 1e-3 * 3)


def test_without_float64_a_half_precision_models_nudged_twin_is_the_yardstick():
    """gpt_oss runs in bfloat16 only (no float64 run): a sum in another order moves a router's
    scores near a tie, a token picks another expert, and the router's bias gradient moves 20-35%.
    The reference with its weights nudged by one unit in their last place (worker.py) moves it as
    much: that distance is rounding's reach there. A parameter it barely moves is judged as before."""
    expected = {"router.bias": torch.tensor([1.0, -0.5]), "wo.bias": torch.tensor([0.5, 0.25])}
    nudged = {"router.bias": torch.tensor([0.7, -0.5]), "wo.bias": torch.tensor([0.505, 0.25])}
    rounding = rounding_of(expected, None, nudged)
    assert rounding == pytest.approx({"router.bias": 0.3, "wo.bias": 0.005})
    parallel = {"router.bias": torch.tensor([0.8, -0.5]), "wo.bias": torch.tensor([0.5, 0.25])}
    assert gradient_error(expected, parallel, None, 0.03)[0] > 0.03          # 20% off: past bf16's 8u alone
    assert gradient_error(expected, parallel, rounding, 0.03)[0] <= 0.03     # within the twin's reach
    doubled = {**parallel, "wo.bias": 2 * expected["wo.bias"]}
    error, name = gradient_error(expected, doubled, rounding, 0.03)
    assert name == "wo.bias" and error > 5 * 0.03
    assert rounding_of(expected, None, None) == {}


def test_a_reference_whose_first_gradients_are_all_zero_compares_nothing():
    """torchtitan's muse_glimmer zero-initializes its final norm's gain: its output is zero, the
    square of the output has no gradient there, no weight ever moves, and DP=2 "passed" with every
    error 0.0. Such a check cannot fail: verify says so instead of passing it."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 4)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    body = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    head(body(x)).pow(2).mean().backward()
    grads = {name: p.grad for name, p in [*body.named_parameters("body"), *head.named_parameters("head")]}
    assert nothing_to_compare(grads)
    for p in (*body.parameters(), *head.parameters()):
        p.grad = None
    (head(body(x)) - 1).pow(2).mean().backward()        # a loss with a gradient at the zero output
    assert not nothing_to_compare({name: p.grad for name, p in [*head.named_parameters("head")]})


def test_tolerances_follow_the_parameters_dtype_and_the_autocast():
    params32 = {"w": torch.zeros(2), "b": torch.zeros(2)}
    assert derived_tolerance(FLOAT32, None, params32, 3, 1e-3) == ("fp32", FLOAT32)
    # autocast keeps float32 master weights: their steps are not rounded
    precision, tolerance = derived_tolerance(FLOAT32, "bf16", params32, 3, 1e-3)
    assert precision == "bf16" and tolerance["param_atol"] == pytest.approx(2 * 1e-3 * 3)
    # one parameter in fp16 beside bf16 ones: the coarser, bf16, decides
    mixed = {"w": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float16)}
    assert derived_tolerance(FLOAT32, None, mixed, 3, 1e-3)[0] == "bf16"
    assert derived_tolerance(FLOAT32, None, {"w": torch.zeros(2, dtype=torch.float16)}, 3, 1e-3)[0] == "fp16"


# --------------------------------------------------------------------------------------------
# The sensitivity twin: later steps of an unstable run are judged against the reference's own drift
# --------------------------------------------------------------------------------------------

def _result(loss_errors, param_error, grad_error, twin=None) -> VerifyResult:
    reference = [1.0, 5.0, 2.0]
    return VerifyResult(2, 3, reference, [r + e for r, e in zip(reference, loss_errors)], param_error, 0.0, "w",
                        grad_error, "w", {"param_atol": 5e-4, "loss_atol": 1e-4, "rtol": 1e-4, "grad_rtol": 1e-3},
                        1.0, twin=twin)


def test_drift_within_the_twins_is_accepted_and_beyond_it_is_not():
    twin = {"nudge": 4e-6, "loss_errors": [0.0, 2e-5, 3e-4], "max_abs_error": 2e-3}
    assert not _result([0.0, 1e-5, 5e-4], 3e-3, 4e-6).passed                      # fixed tolerances alone
    assert _result([0.0, 1e-5, 5e-4], 3e-3, 4e-6, twin).passed
    assert not _result([0.0, 1e-5, 5e-2], 3e-3, 4e-6, twin).passed                # 160x the twin's drift
    assert not _result([0.0, 1e-5, 5e-4], 5e-2, 4e-6, twin).passed


def test_a_wrong_first_step_is_never_excused_by_the_twin():
    twin = {"nudge": 1e-6, "loss_errors": [1.0, 1.0, 1.0], "max_abs_error": 1.0}
    assert not _result([0.0, 0.0, 0.0], 0.0, 0.5, twin).passed                     # first gradients 50% off
    assert not _result([1e-2, 0.0, 0.0], 0.0, 1e-6, twin).passed                   # first loss off


def test_a_wrong_buffer_after_the_first_forward_is_never_excused_by_the_twin():
    """BatchNorm's running statistics are no gradient: only the first forward's buffers, judged
    before chaos, can tell a wrong update from an unstable model's drift."""
    twin = {"nudge": 1e-6, "loss_errors": [0.0, 1.0, 1.0], "max_abs_error": 1.0}
    wrong = _result([0.0, 0.0, 0.0], 0.1, 1e-6, twin)
    assert wrong.passed
    wrong.max_buffer_error, wrong.worst_buffer = 3e-2, "norm.running_var"
    assert not wrong.passed and not wrong.first_step_passed


def test_the_first_loss_is_judged_against_the_references_own_rounding_and_no_more():
    """A loss through BatchNorm over four values per channel (ResNet-50 at 32x32, batch 4) lands
    1e-4 from its float64 value in the float32 reference itself: a parallel run as far off is
    rounding. Without a float64 loss, or 10x past its rounding, the first loss is an error."""
    def first_loss(error, exact):
        result = _result([error, 0.0, 0.0], 0.0, 1e-6)
        result.exact_first_loss = exact
        return result.first_step_passed

    assert not first_loss(3e-4, None)                       # fixed tolerance 2e-4 alone
    assert first_loss(3e-4, 1.0 - 1e-4)                     # within 10x the reference's rounding
    assert not first_loss(3e-3, 1.0 - 1e-4)                 # 30x past it
    assert not first_loss(3e-4, 1.0)                        # the reference is exact: no excuse


UNSTABLE = '''
import torch
from torch import nn


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 3
        return ((x - y) ** 2).mean()


def build():
    return Deep()


def example_inputs():
    return {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}
'''


@pytest.mark.slow
def test_the_twin_is_a_real_run_whose_first_step_matches_and_later_steps_drift(tmp_path):
    """The worker's --nudge changes nothing before the first optimizer step, and a rounding-sized
    nudge visibly moves an unstable run (lr 0.5) after it."""
    import subprocess
    import sys

    from nnscaler_cst.verify.equivalence import WORKER

    entry = tmp_path / "unstable.py"
    entry.write_text(UNSTABLE)
    common = ["--steps", "4", "--lr", "0.5"]
    for extra in ([], ["--nudge", "1e-6"]):
        subprocess.run([sys.executable, str(WORKER), "reference", str(entry), str(tmp_path), *common, *extra],
                       check=True, capture_output=True)
    ref, twin = (torch.load(tmp_path / f"{name}.pt") for name in ("reference", "twin"))
    assert ref["losses"][0] == twin["losses"][0]
    assert all(torch.equal(ref["grads"][k], twin["grads"][k]) for k in ref["grads"])
    assert ref["losses"][-1] != twin["losses"][-1]


BATCH_NORM_UNSTABLE = '''
import torch
from torch import nn


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))

    def forward(self, x, y):
        x = self.norm(x)
        for layer in self.layers:
            x = torch.tanh(layer(x)) * 3
        return ((x - y) ** 2).mean()


def build():
    return Deep()


def example_inputs():
    return {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}
'''


@pytest.mark.slow
def test_a_wrong_running_variance_in_an_unstable_model_fails(tmp_path):
    """An unstable model (lr 0.5) at DP=2 whose rewritten BatchNorm unbiases the running variance
    by each rank's count (4/3) instead of the whole batch's (8/7): after three steps the twin's
    drift (0.16) covered its error (0.07) and verify passed it; the buffers after the first
    forward show it."""
    import json

    (tmp_path / "bn_unstable.py").write_text(BATCH_NORM_UNSTABLE.lstrip())

    def verify(*args):
        result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "bn_unstable.py", "-o", "out",
                                 "--lr", "0.5", "--json", *args], cwd=tmp_path, capture_output=True, text=True,
                                timeout=600)
        assert result.stdout.find("{") >= 0, result.stdout + result.stderr
        return result.returncode, json.loads(result.stdout[result.stdout.find("{"):])

    code, outcome = verify("--dp", "2")
    assert code == 0 and outcome["passed"] and outcome["max_buffer_error"] < 1e-5, outcome
    comm = tmp_path / "out" / "_comm.py"
    text = comm.read_text()
    right = "var.detach() * count / max(count - 1, 1)"
    assert text.count(right) == 1
    comm.write_text(text.replace(right, "var.detach() * (count // axis.size) / max(count // axis.size - 1, 1)"))
    code, outcome = verify()                                  # as it is: hand-edited, not rewritten
    assert code == 1 and not outcome["passed"] and outcome["worst_buffer"] == "norm.running_var", outcome
    assert outcome["max_buffer_error"] > 10 * outcome["tolerance"]["grad_rtol"], outcome


def test_float64_decides_only_where_float32_failed():
    def result(loss_error, float64=None):
        return VerifyResult(2, 1, [1.0], [1.0 + loss_error], 0.0, 0.0, "w", 0.0, "w",
                            {"param_atol": 1e-4, "loss_atol": 1e-4, "rtol": 1e-4, "grad_rtol": 1e-3},
                            0.0, float64=float64)
    assert result(0.0).passed and not result(1e-2).passed
    assert result(1e-2, float64=result(0.0)).passed
    assert not result(1e-2, float64=result(1e-2)).passed


# Stochastic depth as timm's DropPath and torchvision's StochasticDepth write it: a per-sample keep
# mask drawn with bernoulli_, the kept samples scaled up.
DROP_PATH = """
import torch
from nnscaler_cst.verify.worker import switch_off_dropout


def drop_path(x, p=0.25):
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - p)
    return x * mask.div_(1 - p)


switch_off_dropout()
x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
torch.manual_seed(0)
whole = drop_path(x)
shares = []
for share in x.chunk(2):      # each data-parallel rank draws from the same seed
    torch.manual_seed(0)
    shares.append(drop_path(share))
halves = torch.cat(shares)
assert torch.equal(whole, halves), (whole - halves).abs().max()
assert torch.allclose(whole, x / 0.75) and torch.equal(torch.bernoulli(torch.full((3,), 0.5)), torch.ones(3))
"""


def test_stochastic_depth_is_switched_off_so_a_batch_split_draws_the_same(tmp_path):
    result = subprocess.run([sys.executable, "-c", DROP_PATH], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# Label dropout as diffusers' LabelEmbedding writes it: a uniform draw per sample inside the forward
# decides which class labels to replace by the "no class" entry.
LABEL_DROPOUT = """
import torch
from nnscaler_cst.verify.worker import switch_off_dropout


class LabelEmbedding(torch.nn.Module):
    def __init__(self, classes=10, dim=4, p=0.5):
        super().__init__()
        self.table = torch.nn.Embedding(classes + 1, dim)
        self.classes, self.p = classes, p

    def forward(self, labels):
        drop = torch.rand(labels.shape[0]) < self.p
        return self.table(torch.where(drop, self.classes, labels))


switch_off_dropout()
torch.manual_seed(0)
embed = LabelEmbedding()
labels = torch.randint(0, 10, (8,))
assert torch.rand(1000).max() < 1 and torch.rand(1000).std() > 0.1     # outside a forward: drawn as ever
torch.manual_seed(1)
whole = embed(labels)
shares = []
for share in labels.chunk(2):      # each data-parallel rank draws from the same seed
    torch.manual_seed(1)
    shares.append(embed(share))
assert torch.equal(whole, torch.cat(shares))
assert torch.equal(whole, embed.table(labels))     # every label kept
"""


def test_uniform_draws_in_a_forward_keep_every_sample_so_a_batch_split_draws_the_same():
    result = subprocess.run([sys.executable, "-c", LABEL_DROPOUT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


BFLOAT16_MLP = '''
import torch
import torch.nn.functional as F
from torch import nn

E = 16


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(E, 4 * E)
        self.down = nn.Linear(4 * E, E)

    def forward(self, x):
        x = x.to(torch.bfloat16)       # computes in bfloat16 whatever it is given: no float64 run
        return x + self.down(F.gelu(self.up(x)))


def build():
    return MLP().to(torch.bfloat16)


def example_inputs():
    return (torch.randn(8, 8, E),)


def loss(output):
    return output.float().pow(2).mean()
'''


@pytest.mark.slow
def test_a_bfloat16_model_verifies_and_a_wrong_bfloat16_output_still_fails(tmp_path):
    """A model built in bfloat16 at TP=2: its first gradients land about 2**-8 apart, past
    float32's tolerance (1e-3), so verify called it wrong; judged by bfloat16's, it passes. The
    same output with its row-parallel bias's gradient all-reduced (a tp_copy too many: twice
    the gradient) still fails."""
    import json
    import subprocess
    import sys

    (tmp_path / "bf16_mlp.py").write_text(BFLOAT16_MLP.lstrip())

    def verify(*args):
        result = subprocess.run([sys.executable, "-m", "nnscaler_cst.cli", "verify", "bf16_mlp.py", "-o", "out",
                                 "--json", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert result.stdout.find("{") >= 0, result.stdout + result.stderr
        return result.returncode, json.loads(result.stdout[result.stdout.find("{"):])

    code, outcome = verify("--tp", "2")
    assert code == 0 and outcome["passed"] and outcome["precision"] == "bf16", outcome
    assert outcome["max_grad_error"] > 1e-3, outcome        # float32's tolerance would have failed it
    model = tmp_path / "out" / "model.py"
    text = model.read_text()
    assert text.count(" + self.down.bias)") == 1 and "from ._comm import TP, tp_reduce\n" in text
    model.write_text(text.replace(" + self.down.bias)", " + tp_copy(self.down.bias, TP))").replace(
        "from ._comm import TP, tp_reduce\n", "from ._comm import TP, tp_copy, tp_reduce\n"))
    code, outcome = verify()                                  # as it is: hand-edited, not rewritten
    assert code == 1 and not outcome["passed"] and outcome["worst_grad"] == "down.bias", outcome
    assert outcome["max_grad_error"] > 4 * outcome["tolerance"]["grad_rtol"], outcome
