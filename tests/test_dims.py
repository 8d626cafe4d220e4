"""Spec of the dimension-label language (graph/dims.py) and the structural kinds (graph/kinds.py).

What a label means is checked from first principles, with real torch: *splitting label L* means
giving each of two devices one half of every dim carrying L (for a dim made of factors such as
`(3 c)`, the half of each of the 3 blocks), running the same op on the halves, and then
concatenating the outputs along L, or summing them when L is reduced (`k+`). When the labels
are right, that reproduces the unsplit result exactly. Annotations come from the real
rules/ops/*.toml; shapes come from running the real ops.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from nnscaler_cst.graph.dims import Annotation, DimSpec, DimsError, OpDims, TensorDims, bind
from nnscaler_cst.graph.kinds import Call
from nnscaler_cst.graph.oprules import load_rules

RULES = load_rules()
PARTS = 2


# ---- helpers: instantiate a real rule on a real invocation, and split by its labels ---------------
def instantiate(callee: str, inputs: dict[str, torch.Tensor], outputs: list[torch.Tensor],
                values: dict | None = None) -> OpDims:
    """The labels the rule for `callee` gives this invocation (tensor ids: inputs, then outputs)."""
    names = list(inputs)
    call = Call({n: tuple(inputs[n].shape) for n in names}, {n: i for i, n in enumerate(names)}, values or {},
                [tuple(o.shape) for o in outputs], list(range(len(names), len(names) + len(outputs))), {})
    return RULES.rule_for(callee).instantiate(call)


def _block(dims: TensorDims, label: str, shape) -> tuple[int, int, int, int]:
    """(dim, groups, label size, inner size) of where `label` sits in a tensor."""
    d, groups = dims.where(label)
    size = next(f.size for f in dims.dims[d] if f.label == label)
    return d, groups, size, shape[d] // (groups * size)


def shard(tensor: torch.Tensor, dims: TensorDims, label: str, rank: int) -> torch.Tensor:
    """Device `rank`'s part of a tensor when `label` is split; the whole tensor if it lacks `label`."""
    if dims.where(label) is None:
        return tensor
    d, groups, size, inner = _block(dims, label, tensor.shape)
    blocks = tensor.unflatten(d, (groups, size, inner))
    return blocks.narrow(d + 1, rank * size // PARTS, size // PARTS).flatten(d, d + 2)


def unshard(pieces: list[torch.Tensor], dims: TensorDims, label: str, full_shape) -> torch.Tensor:
    d, groups, size, inner = _block(dims, label, full_shape)
    blocks = [p.unflatten(d, (groups, size // PARTS, inner)) for p in pieces]
    return torch.cat(blocks, dim=d + 1).flatten(d, d + 2)


def split_reproduces(op, inputs: dict[str, torch.Tensor], dims: OpDims, label: str) -> None:
    """Run `op` on every device's shards and combine as the labels say; compare with the whole op."""
    def as_list(out):
        return list(out) if isinstance(out, (tuple, list)) else [out]

    full = as_list(op(**inputs))
    per_rank = [as_list(op(**{n: shard(t, dims.inputs[n], label, r) if n in dims.inputs else t
                              for n, t in inputs.items()}))
                for r in range(PARTS)]
    for i, (whole, out_dims) in enumerate(zip(full, dims.outputs)):
        pieces = [outs[i] for outs in per_rank]
        if label in dims.reduced:
            combined = sum(pieces)
        elif out_dims.where(label) is None:
            combined = pieces[0]
        else:
            combined = unshard(pieces, out_dims, label, whole.shape)
        assert_close(combined, whole, rtol=1e-5, atol=1e-5)


def labels_at(dims: TensorDims, d: int) -> list[str]:
    return [f.label for f in dims.dims[d]]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- the annotation language ----------------------------------------------------------------------
def test_parse_reads_operand_aliases_optional_operands_and_outputs():
    ann = Annotation.parse("arg0|input: *b k+, arg1|weight: n k+, arg2|bias?: n -> *b n")
    assert [op.names for op in ann.operands] == [["arg0", "input"], ["arg1", "weight"], ["arg2", "bias"]]
    assert [op.optional for op in ann.operands] == [False, False, True]
    assert ann.operands[1].dims == DimSpec([["n"], ["k+"]])
    assert ann.outputs == [DimSpec([["*b"], ["n"]])]


def test_parse_reads_a_parenthesized_dim_as_one_dim_of_several_factors():
    ann = Annotation.parse("arg0: *b (3 c) -> *b c")
    assert ann.operands[0].dims == DimSpec([["*b"], ["3", "c"]])


def test_parse_rejects_an_annotation_without_an_arrow():
    with pytest.raises(ValueError):
        Annotation.parse("arg0: a b")


def test_nothing_after_the_arrow_is_one_scalar_output():
    ann = Annotation.parse("arg0: n v -> ")
    dims = bind(ann, {"arg0": (8, 5)}, {"arg0": 0}, [()], [1])
    assert ann.outputs == [DimSpec([])] and dims.outputs == [TensorDims(1, [])]


def test_a_bracketed_output_stands_for_every_output():
    ann = Annotation.parse("arg0: a b -> [a b]...")
    dims = bind(ann, {"arg0": (2, 3)}, {"arg0": 0}, [(2, 3)] * 3, [1, 2, 3])
    assert [labels_at(t, 0) + labels_at(t, 1) for t in dims.outputs] == [["a", "b"]] * 3


# ---- linear: the contracted dim is reduced ----------------------------------------------------------
@pytest.fixture
def linear():
    x, w, b = torch.randn(4, 16, 64), torch.randn(96, 64), torch.randn(96)
    dims = instantiate("torch.nn.functional.linear", {"arg0": x, "arg1": w, "arg2": b}, [F.linear(x, w, b)])
    return x, w, b, dims


def test_linear_contracted_dim_is_one_label_on_input_and_weight_and_missing_from_the_output(linear):
    _, _, _, dims = linear
    k = labels_at(dims.inputs["arg0"], 2)
    assert k == labels_at(dims.inputs["arg1"], 1) and k[0] in dims.reduced
    assert k[0] not in dims.outputs[0].labels()


def test_linear_split_on_the_contracted_dim_gives_partial_sums(linear):
    x, w, _, _ = linear
    dims = instantiate("torch.nn.functional.linear", {"arg0": x, "arg1": w}, [F.linear(x, w)])
    [k] = labels_at(dims.inputs["arg0"], 2)
    split_reproduces(lambda arg0, arg1: F.linear(arg0, arg1), {"arg0": x, "arg1": w}, dims, k)


def test_linear_split_on_the_output_features_splits_weight_rows_and_bias(linear):
    x, w, b, dims = linear
    [n] = labels_at(dims.outputs[0], 2)
    assert labels_at(dims.inputs["arg1"], 0) == labels_at(dims.inputs["arg2"], 0) == [n]
    split_reproduces(lambda arg0, arg1, arg2: F.linear(arg0, arg1, arg2), {"arg0": x, "arg1": w, "arg2": b}, dims, n)


def test_linear_batch_dims_are_shared_by_input_and_output_and_splittable(linear):
    x, w, b, dims = linear
    for d in (0, 1):
        [label] = labels_at(dims.inputs["arg0"], d)
        assert labels_at(dims.outputs[0], d) == [label] and label in dims.splittable()
        split_reproduces(lambda arg0, arg1, arg2: F.linear(arg0, arg1, arg2), {"arg0": x, "arg1": w, "arg2": b},
                         dims, label)


def test_linear_optional_bias_may_be_absent():
    x, w = torch.randn(4, 64), torch.randn(96, 64)
    dims = instantiate("torch.nn.functional.linear", {"arg0": x, "arg1": w}, [F.linear(x, w)])
    assert set(dims.inputs) == {"arg0", "arg1"}


# ---- fused q|k|v: (3 c) ------------------------------------------------------------------------------
@pytest.fixture
def fused_split():
    qkv = torch.randn(4, 16, 3 * 64)
    outs = qkv.split(64, dim=2)
    dims = instantiate("Tensor.split", {"arg0": qkv}, list(outs), {"arg1": 64, "dim": 2})
    return qkv, dims


def test_split_into_three_equal_pieces_makes_the_input_dim_3_blocks_of_c(fused_split):
    _, dims = fused_split
    factors = dims.inputs["arg0"].dims[2]
    assert [(f.label, f.size) for f in factors] == [("3", 3), ("c", 64)]
    assert [labels_at(out, 2) for out in dims.outputs] == [["c"]] * 3


def test_splitting_c_shards_each_of_the_3_blocks(fused_split):
    _, dims = fused_split
    assert dims.inputs["arg0"].where("c") == (2, 3)       # dim 2, in 3 interleaved blocks
    assert "c" in dims.splittable() and "3" not in dims.splittable()


def test_splitting_c_gives_each_device_its_part_of_q_k_and_v(fused_split):
    qkv, dims = fused_split
    # the split size is the local one on each device, as a rewrite writes it (C // 2)
    split_reproduces(lambda arg0: arg0.split(arg0.shape[2] // 3, dim=2), {"arg0": qkv}, dims, "c")


def test_split_into_unequal_pieces_cannot_split_that_dim():
    x = torch.randn(4, 96)
    outs = x.split([32, 64], dim=1)
    dims = instantiate("Tensor.split", {"arg0": x}, list(outs), {"arg1": [32, 64], "dim": 1})
    assert not set(labels_at(dims.inputs["arg0"], 1)) & set(dims.splittable())
    assert labels_at(dims.inputs["arg0"], 0)[0] in dims.splittable()


# ---- grouped-query attention: (g r) ---------------------------------------------------------------------
@pytest.fixture
def gqa():
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    dims = instantiate("torch.nn.functional.scaled_dot_product_attention", {"arg0": q, "arg1": k, "arg2": v}, [out])
    return q, k, v, dims


def test_gqa_binding_infers_the_query_heads_per_kv_head(gqa):
    _, _, _, dims = gqa
    assert dims.sizes()["g"] == 2 and dims.sizes()["r"] == 4
    assert [(f.label, f.size) for f in dims.inputs["arg0"].dims[1]] == [("g", 2), ("r", 4)]


def test_gqa_split_on_kv_heads_keeps_each_query_head_with_its_kv_head(gqa):
    q, k, v, dims = gqa
    split_reproduces(lambda arg0, arg1, arg2: F.scaled_dot_product_attention(arg0, arg1, arg2, enable_gqa=True),
                     {"arg0": q, "arg1": k, "arg2": v}, dims, "g")


def test_gqa_head_dim_is_fixed(gqa):
    _, _, _, dims = gqa
    assert "d" in dims.fixed and "d" not in dims.splittable()


def test_gqa_with_query_heads_not_a_multiple_of_kv_heads_does_not_bind():
    q, k = torch.randn(2, 6, 16, 32), torch.randn(2, 4, 16, 32)
    with pytest.raises(DimsError):
        instantiate("torch.nn.functional.scaled_dot_product_attention", {"arg0": q, "arg1": k, "arg2": k},
                    [torch.empty(2, 6, 16, 32)])


def test_transformers_attention_rule_matches_transformers_own_head_grouping():
    # transformers' sdpa_attention_forward repeats kv heads (repeat_kv) and returns (b, s, heads, d).
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=4, is_causal=True)
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)

    def attention(query, key, value):
        return sdpa_attention_forward(module, query, key, value, None)[0]

    dims = instantiate("transformers.integrations.sdpa_attention.sdpa_attention_forward",
                       {"query": q, "key": k, "value": v}, [attention(q, k, v)])
    assert labels_at(dims.outputs[0], 2) == ["g", "r"]
    split_reproduces(attention, {"query": q, "key": k, "value": v}, dims, "g")


def _masked_attention(arg0, arg1, arg2, arg3):
    return F.scaled_dot_product_attention(arg0, arg1, arg2, attn_mask=arg3, enable_gqa=True)


@pytest.mark.parametrize("mask_shape, batch_labelled, heads_labelled",
                         [((2, 1, 16, 16), True, False), ((1, 1, 16, 16), False, False), ((16, 16), False, False),
                          ((1, 8, 16, 16), False, True), ((8, 16, 16), False, True), ((2, 8, 16, 16), True, True)])
def test_an_attention_mask_goes_with_the_samples_heads_and_queries_and_broadcasts_where_it_is_size_1(
        mask_shape, batch_labelled, heads_labelled):
    # A per-sample mask (b, 1, s, t) splits with the batch; a per-head one (a relative-position
    # bias of (1, heads, s, t)) with the heads; a mask shared by all samples or heads (a size-1
    # dim, or none at all: `...` lets it lack leading dims) is whole on every device.
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    mask = torch.randn(mask_shape)
    inputs = {"arg0": q, "arg1": k, "arg2": v, "arg3": mask}
    dims = instantiate("torch.nn.functional.scaled_dot_product_attention", inputs, [_masked_attention(**inputs)])
    batch = labels_at(dims.inputs["arg0"], 0)
    assert (dims.inputs["arg3"].where(batch[0]) is not None) == batch_labelled
    assert (dims.inputs["arg3"].where("g") is not None) == heads_labelled
    assert "s" in dims.inputs["arg3"].labels() and batch[0] not in dims.fixed
    for label in (batch[0], "g", "s"):
        split_reproduces(_masked_attention, inputs, dims, label)


def test_transformers_attention_mask_of_the_samples_splits_with_the_batch():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=4, is_causal=False)
    q, k, v = torch.randn(2, 8, 16, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32)
    mask = torch.randn(2, 1, 16, 16)

    def attention(query, key, value, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask)[0]

    inputs = {"query": q, "key": k, "value": v, "attention_mask": mask}
    dims = instantiate("transformers.integrations.sdpa_attention.sdpa_attention_forward", inputs, [attention(**inputs)])
    batch = labels_at(dims.inputs["query"], 0)[0]
    assert labels_at(dims.inputs["attention_mask"], 0) == [batch] and batch not in dims.fixed
    split_reproduces(attention, inputs, dims, batch)


# ---- reshape: C -> (nh, hs) ---------------------------------------------------------------------------
@pytest.fixture
def to_heads():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.view", {"arg0": x}, [x.view(4, 16, 4, 16)], {"arg1": 4, "arg2": 16, "arg3": 4, "arg4": 16})
    return x, dims


def test_reshape_into_heads_makes_the_input_dim_heads_then_head_size(to_heads):
    _, dims = to_heads
    heads, head_size = labels_at(dims.outputs[0], 2), labels_at(dims.outputs[0], 3)
    assert labels_at(dims.inputs["arg0"], 2) == heads + head_size


def test_reshape_into_heads_splits_heads_whole_and_later_factors_in_groups(to_heads):
    """Heads: one contiguous block each. A later factor (head size here; the heads of a
    (3, heads, hd) qkv) splits inside every block of the factors before it: groups = their product."""
    x, dims = to_heads
    [heads], [head_size] = labels_at(dims.outputs[0], 2), labels_at(dims.outputs[0], 3)
    assert dims.inputs["arg0"].where(heads) == (2, 1)
    assert dims.inputs["arg0"].where(head_size) == (2, 4) and head_size in dims.splittable()
    split_reproduces(lambda arg0: arg0.view(4, 16, 4, -1), {"arg0": x}, dims, head_size)


def test_reshape_split_on_heads_gives_each_device_whole_heads(to_heads):
    x, dims = to_heads
    [heads] = labels_at(dims.outputs[0], 2)
    split_reproduces(lambda arg0: arg0.view(4, 16, -1, 16), {"arg0": x}, dims, heads)


def test_reshape_back_from_heads_splits_the_merged_dim_on_heads():
    y = torch.randn(4, 16, 4, 16)
    dims = instantiate("Tensor.reshape", {"arg0": y}, [y.reshape(4, 16, 64)], {"arg1": (4, 16, 64)})
    [heads] = labels_at(dims.inputs["arg0"], 2)
    assert labels_at(dims.outputs[0], 2)[0] == heads and heads in dims.splittable()
    split_reproduces(lambda arg0: arg0.reshape(4, 16, -1), {"arg0": y}, dims, heads)


def test_reshape_that_regroups_dims_cannot_split_them():
    x = torch.randn(6, 4)
    dims = instantiate("Tensor.view", {"arg0": x}, [x.view(4, 6)], {"arg1": 4, "arg2": 6})
    assert dims.splittable() == []


def test_a_regrouping_reshape_still_splits_its_outermost_dim_when_the_sizes_nest():
    """ConvBERT's (B, S, heads * k) -> (-1, k, 1): the batch is the outer part of the merged dim."""
    x = torch.randn(4, 16, 36)
    dims = instantiate("torch.reshape", {"arg0": x}, [x.reshape(-1, 9, 1)], {"arg1": [-1, 9, 1]})
    [batch] = labels_at(dims.inputs["arg0"], 0)
    assert labels_at(dims.outputs[0], 0)[0] == batch and dims.splittable() == [batch]
    split_reproduces(lambda arg0: torch.reshape(arg0, [-1, 9, 1]), {"arg0": x}, dims, batch)


def test_a_regrouping_view_splits_an_inner_dim_that_leads_its_group():
    """FSMT's (T, B, H) -> (-1, B * heads, head_dim): B leads the merged B * heads."""
    x = torch.randn(16, 4, 64)
    dims = instantiate("Tensor.view", {"arg0": x}, [x.view(-1, 16, 16)], {"arg1": -1, "arg2": 16, "arg3": 16})
    [batch] = labels_at(dims.inputs["arg0"], 1)
    assert labels_at(dims.outputs[0], 1)[0] == batch and batch in dims.splittable()
    split_reproduces(lambda arg0: arg0.view(-1, arg0.shape[1] * 4, 16), {"arg0": x}, dims, batch)


# ---- getitem ---------------------------------------------------------------------------------------------
def test_getitem_full_slices_keep_their_dims_label():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.__getitem__", {"arg0": x}, [x[:, 0:8]], {"arg1": (slice(None), slice(0, 8))})
    for d in (0, 2):
        assert labels_at(dims.outputs[0], d) == labels_at(dims.inputs["arg0"], d)
        split_reproduces(lambda arg0: arg0[:, 0:8], {"arg0": x}, dims, labels_at(dims.inputs["arg0"], d)[0])


def test_getitem_partial_slice_fixes_that_dim():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.__getitem__", {"arg0": x}, [x[:, 0:8]], {"arg1": (slice(None), slice(0, 8))})
    [sliced] = labels_at(dims.inputs["arg0"], 1)
    assert sliced in dims.fixed and sliced not in dims.splittable()
    assert labels_at(dims.outputs[0], 1) == []


def test_getitem_integer_index_drops_the_dim_and_fixes_it():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.__getitem__", {"arg0": x}, [x[:, 3]], {"arg1": (slice(None), 3)})
    [indexed] = labels_at(dims.inputs["arg0"], 1)
    assert len(dims.outputs[0].dims) == 2 and indexed in dims.fixed
    assert labels_at(dims.outputs[0], 1) == labels_at(dims.inputs["arg0"], 2)


def test_getitem_with_ellipsis_and_none_aligns_the_remaining_dims():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.__getitem__", {"arg0": x}, [x[..., None]], {"arg1": (Ellipsis, None)})
    assert [labels_at(dims.outputs[0], d) for d in range(3)] == [labels_at(dims.inputs["arg0"], d) for d in range(3)]
    assert labels_at(dims.outputs[0], 3) == []


def test_getitem_with_a_tensor_index_is_not_annotated():
    x = torch.randn(4, 16)
    with pytest.raises(DimsError):
        instantiate("Tensor.__getitem__", {"arg0": x, "arg1": torch.tensor([0, 2])}, [x[torch.tensor([0, 2])]])


# ---- reductions: sum is partial, mean is fixed -------------------------------------------------------------
def test_sum_over_a_dim_marks_it_reduced_and_partial_sums_add_up():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.sum", {"arg0": x}, [x.sum(-1)], {"arg1": -1})
    [summed] = labels_at(dims.inputs["arg0"], 2)
    assert summed in dims.reduced and summed not in dims.outputs[0].labels()
    split_reproduces(lambda arg0: arg0.sum(-1), {"arg0": x}, dims, summed)


def test_mean_over_a_dim_marks_it_fixed_because_partial_means_do_not_add_up():
    x = torch.randn(4, 16, 64) + 1.0
    dims = instantiate("Tensor.mean", {"arg0": x}, [x.mean(-1)], {"arg1": -1})
    [averaged] = labels_at(dims.inputs["arg0"], 2)
    assert averaged in dims.fixed and averaged not in dims.reduced and averaged not in dims.splittable()
    halves = x.chunk(2, dim=-1)
    assert not torch.allclose(halves[0].mean(-1) + halves[1].mean(-1), x.mean(-1))


def test_sum_keeps_the_labels_of_the_dims_it_does_not_reduce():
    x = torch.randn(4, 16, 64)
    dims = instantiate("Tensor.sum", {"arg0": x}, [x.sum(-1)], {"arg1": -1})
    [batch] = labels_at(dims.inputs["arg0"], 0)
    split_reproduces(lambda arg0: arg0.sum(-1), {"arg0": x}, dims, batch)


# ---- broadcasting --------------------------------------------------------------------------------------
def test_elementwise_broadcast_operand_shares_the_label_of_the_dim_it_broadcasts_to():
    x, bias = torch.randn(4, 16, 64), torch.randn(64)
    dims = instantiate("Tensor.add", {"arg0": x, "arg1": bias}, [x + bias])
    assert labels_at(dims.inputs["arg1"], 0) == labels_at(dims.outputs[0], 2)
    split_reproduces(lambda arg0, arg1: arg0 + arg1, {"arg0": x, "arg1": bias}, dims, labels_at(dims.outputs[0], 2)[0])


def test_elementwise_size_one_dims_carry_no_label():
    x, mask = torch.randn(4, 4, 16, 16), torch.ones(1, 1, 16, 16)
    dims = instantiate("Tensor.masked_fill", {"arg0": x, "arg1": mask.bool()}, [x.masked_fill(mask.bool(), 0.0)])
    assert labels_at(dims.inputs["arg1"], 0) == labels_at(dims.inputs["arg1"], 1) == []


# ---- a label that leaves the outputs ------------------------------------------------------------------------
def test_a_label_missing_from_the_outputs_is_splittable_only_if_reduced_or_implemented():
    ann = Annotation.parse("arg0: n^ v, arg1: n^ -> ")
    dims = bind(ann, {"arg0": (8, 100), "arg1": (8,)}, {"arg0": 0, "arg1": 1}, [()], [2])
    assert "v" not in dims.splittable()
    dims.impl = {"v": "vocab_parallel_cross_entropy"}
    assert dims.splittable() == ["v"]


# ---- what does not fit ------------------------------------------------------------------------------------
LINEAR = Annotation.parse("arg0|input: *b k+, arg1|weight: n k+, arg2|bias?: n -> *b n")


def test_rank_mismatch_is_a_dims_error():
    with pytest.raises(DimsError, match="rank"):
        bind(LINEAR, {"arg0": (4, 64), "arg1": (96,)}, {"arg0": 0, "arg1": 1}, [(4, 96)], [2])


def test_the_same_label_with_two_sizes_is_a_dims_error():
    with pytest.raises(DimsError):
        bind(LINEAR, {"arg0": (4, 64), "arg1": (96, 32)}, {"arg0": 0, "arg1": 1}, [(4, 96)], [2])


def test_a_missing_required_operand_is_a_dims_error():
    with pytest.raises(DimsError):
        bind(LINEAR, {"arg0": (4, 64)}, {"arg0": 0}, [(4, 96)], [2])


def test_a_wrong_number_of_outputs_is_a_dims_error():
    with pytest.raises(DimsError):
        bind(LINEAR, {"arg0": (4, 64), "arg1": (96, 64)}, {"arg0": 0, "arg1": 1}, [(4, 96), (4, 96)], [2, 3])


def test_variadic_batch_dims_are_aligned_from_the_right():
    dims = bind(LINEAR, {"arg0": (2, 3, 4, 64), "arg1": (96, 64)}, {"arg0": 0, "arg1": 1}, [(2, 3, 4, 96)], [2])
    leading = [labels_at(dims.inputs["arg0"], d) for d in range(3)]
    assert leading == [labels_at(dims.outputs[0], d) for d in range(3)]
    assert len({tuple(l) for l in leading}) == 3


# ---- [[ctor]] rules of subclasses ---------------------------------------------------------------------------

SUBCLASSES = '''
from torch import nn


class Renamed(nn.Embedding):
    """FSMT's sinusoidal table: nn.Embedding's arguments under other names."""

    def __init__(self, num_positions, embedding_dim, padding_idx):
        super().__init__(num_positions, embedding_dim, padding_idx)


class Reordered(nn.Embedding):
    def __init__(self, dim, count):
        nn.Embedding.__init__(self, count, embedding_dim=dim)


class Computed(nn.Embedding):
    def __init__(self, count, dim):
        super().__init__(count, dim * 2)
'''


def test_a_subclass_ctor_rule_follows_its_super_init_call(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "subclasses_for_ctor.py").write_text(SUBCLASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("subclasses_for_ctor")
    rules = load_rules()
    renamed = rules.ctor_for("subclasses_for_ctor.Renamed")
    assert renamed.params["weight"] == [["arg0", "num_positions"], ["arg1", "embedding_dim"]]
    reordered = rules.ctor_for("subclasses_for_ctor.Reordered")
    assert reordered.params["weight"] == [["arg1", "count"], ["arg0", "dim"]]
    assert rules.ctor_for("subclasses_for_ctor.Computed") is None     # `dim * 2`: not the argument itself


def test_a_depthwise_convolution_does_not_fit_the_conv2d_rule():
    """groups = channels: the weight is o x 1 x kh x kw, not o x c x kh x kw. Read as a broadcast
    of c, the rule let the planner split out_channels alone (nn.Conv2d(8, 8 // 2, groups=8):
    CvT's build raised in the dry run); the call gets a derived rule instead."""
    x, weight = torch.randn(2, 8, 6, 6), torch.randn(8, 1, 3, 3)
    out = F.conv2d(x, weight, padding=1, groups=8)
    with pytest.raises(DimsError, match="self.weight has size 1 where dim c is 8"):
        instantiate("torch.nn.Conv2d", {"arg0": x, "self.weight": weight}, [out])
    dense = instantiate("torch.nn.Conv2d", {"arg0": x, "self.weight": torch.randn(4, 8, 3, 3)},
                        [torch.randn(2, 4, 6, 6)])
    assert labels_at(dense.inputs["self.weight"], 1) == ["c"]


def test_a_weight_of_size_one_still_fits_where_its_dim_is_one_everywhere():
    x, weight = torch.randn(4, 8), torch.randn(1, 8)
    dims = instantiate("torch.nn.Linear", {"arg0": x, "self.weight": weight}, [x @ weight.T])
    assert labels_at(dims.inputs["self.weight"], 0) == []


def test_a_fresh_cache_hands_back_the_indexer_keys_it_is_given_split_as_they_come():
    # DeepSeek-V3.2-style indexers (axk2) route their keys through Cache.update_indexer; in training
    # the cache starts empty, so it returns its operand, as Cache.update does: the batch may be split.
    keys = torch.randn(4, 16, 96)
    dims = instantiate("transformers.cache_utils.Cache.update_indexer", {"indexer_key_states": keys}, [keys])
    assert dims.inputs["indexer_key_states"].dims == dims.outputs[0].dims and all(dims.outputs[0].dims)
    assert not dims.fixed


def test_a_cache_update_given_one_tensor_twice_labels_both_names_alike():
    """DeepSeek-V4's shared-KV cache: `past_key_values.update(kv, kv, i)` returns `full, full`,
    one result for two arguments. Both names are the one tensor: the second was left unlabelled,
    and data parallelism was refused ("cannot split its operand value_states on the batch dim")."""
    kv = (4, 1, 16, 8)
    call = Call({"key_states": kv, "value_states": kv}, {"key_states": 7, "value_states": 7}, {}, [kv], [9], {})
    dims = RULES.rule_for("transformers.cache_utils.Cache.update").instantiate(call)
    assert dims.inputs["value_states"].dims == dims.inputs["key_states"].dims == dims.outputs[0].dims
    assert dims.inputs["value_states"].dims[0]          # the batch dim, labelled
