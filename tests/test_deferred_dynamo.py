"""The fake trace no longer imports torch._dynamo (trace/deferred_dynamo.py), and a later use of
dynamo still gets the one real package. Each check runs in a fresh interpreter: whether the
package is imported is process state."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_fake_trace_of_a_plain_model_leaves_dynamo_unimported():
    out = _run(f"""
        import sys
        from nnscaler_cst.analysis import analyze
        analysis = analyze({str(FIXTURES / 'complex_rotary.py')!r})
        assert analysis.trace.mode == "fake", analysis.trace.mode
        print(type(sys.modules["torch._dynamo"]).__name__, "torch._inductor" in sys.modules)
    """)
    assert out.split() == ["_Placeholder", "False"]


def test_dynamo_used_after_the_trace_is_the_one_real_package():
    out = _run(f"""
        import sys, torch
        from nnscaler_cst.analysis import analyze
        analyze({str(FIXTURES / 'complex_rotary.py')!r})
        config = sys.modules["torch._dynamo.config"]
        import torch._dynamo.source as source           # a submodule import realizes the package
        package = sys.modules["torch._dynamo"]
        assert type(package).__name__ == "module" and torch._dynamo is package
        assert package.source is source is sys.modules["torch._dynamo.source"]
        assert package.config is config                 # the package adopted the config loaded early
        twice = torch.compile(lambda x: x * 2, backend="eager")
        print(twice(torch.ones(3)).tolist())
    """)
    assert out.strip().splitlines()[-1] == "[2.0, 2.0, 2.0]"


def test_attribute_use_realizes_the_package_too():
    out = _run("""
        import sys, torch
        from nnscaler_cst.trace.deferred_dynamo import defer
        defer()
        assert type(sys.modules["torch._dynamo"]).__name__ == "_Placeholder"
        disabled = torch._dynamo.disable(lambda x: x + 1)    # torch's own _disable_dynamo asks this
        assert disabled(1) == 2
        reset = torch._dynamo.reset                          # anything else: the real package
        assert type(sys.modules["torch._dynamo"]).__name__ == "module"
        assert torch._dynamo.disable(lambda x: x + 1)(1) == 2
        print("ok")
    """)
    assert out.strip() == "ok"
