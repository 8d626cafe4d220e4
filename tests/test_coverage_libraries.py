"""The coverage benchmark's enumerators of other libraries (benchmarks/coverage_libraries.py), on
what needs no library beyond torch: the entries they write run, the order spreads over families,
and tiny settings go only to the arguments a class takes."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


libraries = load(BENCHMARKS / "coverage_libraries.py", "coverage_libraries_under_test")


def test_torch_nn_entries_build_run_and_train(tmp_path):
    archs = libraries.torch_nn_archs()
    assert [a.model_class for a in archs] == ["nn.TransformerEncoder", "nn.Transformer", "nn.TransformerDecoder",
                                              "nn.LSTM", "nn.GRU", "nn.MultiheadAttention blocks",
                                              "nn.Conv2d + nn.BatchNorm2d"]
    for arch in archs:
        [(note, text)] = arch.variants()
        path = tmp_path / f"{arch.name}.py"
        path.write_text(text)
        entry = load(path, f"entry_{arch.name}")
        model = entry.build()
        output = model(*entry.example_inputs())
        if arch.model_class != "nn.Conv2d + nn.BatchNorm2d":       # language models: logits per token
            assert output.shape == (libraries.BATCH, libraries.SEQ, libraries.VOCAB), arch.name
        value = entry.loss(output)
        value.backward()
        assert value.dim() == 0 and torch.isfinite(value)
        assert all(p.grad is not None for p in model.parameters())


def test_torchvision_losses_take_the_logits_of_a_namedtuple_output_and_have_a_gradient_at_zero():
    # GoogLeNet returns GoogLeNetOutputs(logits, aux_logits2, aux_logits1) while training: the
    # entry called .float() on the namedtuple; ViT's zero-initialized head outputs all zeros
    import collections
    import ast
    Outputs = collections.namedtuple("Outputs", "logits aux2 aux1")
    logits = torch.randn(2, 3)
    for task in ("classification", "video"):
        text = libraries.entry_text(task, [], ["pass"], ["pass"], libraries.torchvision_loss(task),
                                    helpers=libraries.FIRST_TENSOR)
        scope = {"torch": torch}
        exec(compile(ast.parse(text), "entry", "exec"), scope)
        expected = (logits - 1).pow(2).mean()
        assert torch.equal(scope["loss"](Outputs(logits, torch.ones(2, 3), torch.ones(2, 3))), expected), task
        assert torch.equal(scope["loss"](logits), expected), task
        zero = torch.zeros(2, 3, requires_grad=True)
        scope["loss"](zero).backward()
        assert (zero.grad != 0).all(), task
    segmentation = libraries.entry_text("s", [], ["pass"], ["pass"], libraries.torchvision_loss("segmentation"),
                                        helpers=libraries.FIRST_TENSOR)
    exec(compile(ast.parse(segmentation), "entry", "exec"), scope)
    assert torch.equal(scope["loss"]({"out": logits, "aux": torch.ones(2, 3)}), (logits - 1).pow(2).mean())
    flow = libraries.entry_text("f", [], ["pass"], ["pass"], libraries.torchvision_loss("optical_flow"),
                                helpers=libraries.FIRST_TENSOR)
    exec(compile(ast.parse(flow), "entry", "exec"), scope)
    assert torch.equal(scope["loss"]([torch.ones(2, 3), logits]), (logits - 1).pow(2).mean())


def test_round_robin_takes_one_from_each_family_before_a_second():
    ordered = libraries.round_robin({"a": ["a1", "a2", "a3"], "b": ["b1"], "c": ["c1", "c2"]}, "lib")
    assert sorted(ordered) == ["a1", "a2", "a3", "b1", "c1", "c2"]
    assert {x[0] for x in ordered[:3]} == {"a", "b", "c"}
    assert {x[0] for x in ordered[3:5]} == {"a", "c"}
    assert ordered == libraries.round_robin({"c": ["c1", "c2"], "a": ["a1", "a2", "a3"], "b": ["b1"]}, "lib")


def test_the_smallest_named_member_of_a_family_is_read_from_its_size_word():
    """timm's size words are tokens of the name, with digits after them (pit_ti_224, cait_xxs24):
    pit_b_224 and cait_m36_384 were picked for being shorter."""
    pick = libraries.smallest_named
    assert pick(["pit_b_224", "pit_s_224", "pit_ti_224", "pit_xs_224", "pit_b_distilled_224"]) == "pit_ti_224"
    assert pick(["cait_m36_384", "cait_s24_224", "cait_xxs36_224", "cait_xxs24_224", "cait_xs24_384"]) \
        == "cait_xxs24_224"
    assert pick(["convnext_base", "convnext_atto", "convnext_femto", "convnext_tiny"]) == "convnext_atto"
    assert pick(["efficientformer_l7", "efficientformer_l1", "efficientformer_l3"]) == "efficientformer_l1"
    assert pick(["vit_large_patch16_224", "vit_base_patch16_224", "vit_huge_patch14_224"]) == "vit_base_patch16_224"
    assert pick(["coat_mini", "coat_tiny", "coat_lite_mini"]) == "coat_tiny"
    # after a number a letter is no size word (a stride); no size word: the shortest name
    assert pick(["levit_384_s8", "levit_128", "levit_256"]) == "levit_128"


def test_tiny_settings_go_only_to_scalar_arguments_the_class_takes():
    class Model:
        def __init__(self, num_classes=1000, depth=12, depths=(2, 2, 6, 2), embed_dim=768, **kwargs):
            pass

    assert libraries.tiny_kwargs(Model, libraries.IMAGE_TINY) == {"num_classes": 10, "depth": 2, "embed_dim": 64}


def test_the_split_share_of_a_model_without_repeated_layers_is_over_every_parameter(tmp_path):
    """DLA's `level0.0.weight` is an nn.Sequential's conv, not a block: with no repeated layers the
    share was of the numbered paths (stems and projections, 5% of dla34's parameters)."""
    coverage = load(BENCHMARKS / "bench_coverage.py", "bench_coverage_under_test")
    plan = tmp_path / "plan.json"
    plan.write_text('{"params": {"level0.0.weight": {"shape": [4, 4], "tp": "R"}, '
                    '"level2.tree1.conv1.weight": {"shape": [60, 2], "tp": "S(0)"}}}')
    assert coverage.split_share(plan, coverage.block_patterns({}))["share"] == 0.8824
    blocks = coverage.block_patterns({"Block (level2.*)": 2})
    assert coverage.split_share(plan, blocks) == {"share": None, "block_params": 0}    # no `level2.N.` path


def test_torchtitan_entries_loss_has_a_gradient_at_an_all_zero_output():
    # a zero-initialized final norm makes the output all zero at init: the loss must still
    # give every output element a gradient, else verify's gradient check compares nothing
    import ast
    for note, text in libraries.torchtitan_variants("llama3", "debugmodel"):
        [fn] = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "loss"]
        scope = {"torch": torch}
        exec(compile(ast.Module([fn], []), "loss", "exec"), scope)
        output = torch.zeros(libraries.BATCH, libraries.SEQ, libraries.VOCAB, requires_grad=True)
        scope["loss"](output).backward()
        assert (output.grad != 0).all(), note


def test_a_model_package_that_does_not_import_has_its_flavors_read_from_its_source(tmp_path):
    # torchtitan's qwen3_5 needs flash-linear-attention, flux needs `datasets`: their flavors
    # (debugmodel_moe, flux-debug) are still listed, and skipped with the import's reason
    package = tmp_path / "__init__.py"
    package.write_text("import a_missing_dependency\n\n"
                       "def _debug():\n    pass\n\n"
                       "zoo_configs = {\n    'debugmodel': _debug,\n    'debugmodel_moe': _debug,\n    '8B': _debug,\n}\n"
                       "other = {'not_a_flavor': 1}\n")
    assert libraries.configs_in_source(package) == ["debugmodel", "debugmodel_moe", "8B"]


def test_entries_loss_keeps_a_float64_run_in_float64_and_sums_half_outputs_in_float32():
    # verify's second opinion runs both sides in float64: a loss cast to float32 rounded it back,
    # and efficientnet_b0 missed by one float32 ulp of its loss while float64 params agreed to 6e-9
    import ast
    texts = [text for arch in libraries.torch_nn_archs() for _, text in arch.variants()]
    texts += [text for _, text in libraries.torchtitan_variants("llama3", "debugmodel")]
    for text in texts:
        [fn] = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "loss"]
        scope = {"torch": torch}
        exec(compile(ast.Module([fn], []), "loss", "exec"), scope)
        assert scope["loss"](torch.randn(2, 3, dtype=torch.float64)).dtype == torch.float64
        assert scope["loss"](torch.randn(2, 3, dtype=torch.bfloat16)).dtype == torch.float32


def test_a_verify_failure_without_a_traceback_is_classified_by_its_own_line():
    """verify's own finding (a parameter missing from the merged state dict) is the last line of
    stderr, with no traceback after it: the reason is that line, not "no output"."""
    sys.path.insert(0, str(BENCHMARKS))
    bench = load(BENCHMARKS / "bench_coverage.py", "bench_coverage_under_test")
    err = "wrote out_pp2/: 11 files\nverify failed: the parallel run has no vision.pos_embed\n"
    status, reason, _ = bench.classify("pp2", 1, '{"error": "verify failed"}', err, None)
    assert status == "crash" and "the parallel run has no vision.pos_embed" in reason
