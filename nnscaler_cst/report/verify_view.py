"""`verify`: per-step losses side by side, and the error of the merged parameters."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..verify.equivalence import VerifyResult


def verify_table(result: VerifyResult) -> Group:
    table = Table(header_style="bold", title=f"{result.world_size} gloo processes vs 1 process, "
                                             f"{result.steps} AdamW steps")
    for column in ("step", "reference loss", "parallel loss", "|difference|"):
        table.add_column(column, justify="right")
    for step, (ref, par, err) in enumerate(zip(result.reference_losses, result.parallel_losses, result.loss_errors)):
        table.add_row(str(step), f"{ref:.7f}", f"{par:.7f}", f"{err:.2e}")
    verdict = Text("PASSED" if result.passed else "FAILED", style="bold green" if result.passed else "bold red")
    summary = Text(f"merged parameters after the last step: max abs error {result.max_abs_error:.2e} "
                   f"({result.worst_param}), tolerance {result.tolerance['param_atol']:.0e}; first-step "
                   f"gradients: max error {result.max_grad_error:.2e} of the largest ({result.worst_grad}), "
                   f"tolerance {result.tolerance['grad_rtol']:.0e}; dropout off in both runs; "
                   f"{result.seconds:.1f}s  ")
    return Group(table, summary + verdict)
