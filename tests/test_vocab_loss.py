"""A vocabulary-split head fused with its cross entropy (issue 29): the runtime's head returns a
placeholder and vocab_cross_entropy runs the head and the loss as one step (runtime/_comm.py).
In one process (PP_TP of one device) the fused step must give F.cross_entropy's loss and the
gradients of the head's input and weight; the gloo run of a tied model is in test_interlaced."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler_cst.runtime import _comm


def _head(vocab=10, hidden=8, fused=True):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.head = torch.nn.Linear(hidden, vocab, bias=False)
    reference = torch.nn.Linear(hidden, vocab, bias=False)
    reference.weight = torch.nn.Parameter(model.head.weight.detach().clone())
    _comm.vocab_split(model, ["head"], losses=["head"] if fused else [])
    return model.head, reference


CASES = [dict(), dict(reduction="sum"), dict(reduction="none"), dict(ignore_index=3),
         dict(ignore_index=-100, label_smoothing=0.1), dict(reduction="none", ignore_index=3, label_smoothing=0.2)]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "mean")
@pytest.mark.parametrize("as_module", [False, True], ids=["functional", "module"])
def test_the_fused_head_and_loss_is_the_cross_entropy_of_the_heads_logits(options, as_module):
    head, reference = _head()
    x = torch.randn(2, 3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    target = torch.tensor([[1, 3, 9], [3, options.get("ignore_index", -100), 0]])
    logits = head(x)
    assert logits.shape == (2, 3, 10) and torch.isnan(logits).all()      # never formed
    if as_module:
        loss = _comm.vocab_cross_entropy(logits.view(-1, 10), target.view(-1), loss=torch.nn.CrossEntropyLoss(**options))
    else:
        loss = _comm.vocab_cross_entropy(logits.view(-1, 10), target.view(-1), **options)
    ref = F.cross_entropy(reference(x_ref).view(-1, 10), target.view(-1), **options)
    torch.testing.assert_close(loss, ref)
    upstream = torch.linspace(0.5, 1.5, ref.numel()).view(ref.shape)
    (loss * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(head.weight.grad, reference.weight.grad)
    assert not _comm.VOCAB.pending


def test_logits_that_are_no_fused_heads_take_the_plain_cross_entropy():
    head, _ = _head(fused=False)
    x, target = torch.randn(4, 8), torch.tensor([1, 2, 3, 4])
    logits = head(x)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(_comm.vocab_cross_entropy(logits, target), F.cross_entropy(logits, target))


def test_a_fused_heads_logits_no_loss_takes_are_refused_at_the_steps_end():
    head, _ = _head()
    _comm.vocab_begin(0, 0, [])
    head(torch.randn(4, 8))
    _comm.VOCAB.queue = []
    with pytest.raises(RuntimeError, match="no vocab_cross_entropy took"):
        _comm.vocab_end(1)
    assert not _comm.VOCAB.pending
