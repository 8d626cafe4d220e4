"""verify's gradient check: relative to each tensor's scale and to the gradients' overall scale."""
from __future__ import annotations

import torch

from nnscaler_cst.verify.equivalence import gradient_error


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
