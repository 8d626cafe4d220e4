"""`verify`: per-step losses side by side, and the error of the merged parameters."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..verify.equivalence import TWIN_MARGIN, VerifyResult


def verify_table(result: VerifyResult) -> Group:
    table = Table(header_style="bold", title=f"{result.world_size} gloo processes vs 1 process, "
                                             f"{result.steps} AdamW steps")
    for column in ("step", "reference loss", "parallel loss", "|difference|", "tolerance"):
        table.add_column(column, justify="right")
    for step, (ref, par, err, tol) in enumerate(zip(result.reference_losses, result.parallel_losses,
                                                    result.loss_errors, result.loss_tolerances())):
        table.add_row(str(step), f"{ref:.7f}", f"{par:.7f}", f"{err:.2e}", f"{tol:.0e}")
    verdict = Text("PASSED" if result.passed else "FAILED", style="bold green" if result.passed else "bold red")
    twin = result.twin
    drift = Text(f"the reference is sensitive: a single-device twin whose first gradients differ by "
                 f"{twin['nudge']:.1e} drifts to a last-step loss difference of {twin['loss_errors'][-1]:.2e} "
                 f"and a parameter difference of {twin['max_abs_error']:.2e}; later steps are judged against "
                 f"{TWIN_MARGIN:g}x that drift\n") if twin else Text("")
    if result.noise_driven:
        names = ", ".join(result.noise_driven[:4]) + (f" and {len(result.noise_driven) - 4} more"
                                                        if len(result.noise_driven) > 4 else "")
        drift += Text(f"first gradients that are rounding (zero in float64): {names}; AdamW steps them by "
                      "noise, so their values are not compared, their gradients are\n")
    summary = Text(f"merged parameters after the last step: max abs error {result.max_abs_error:.2e} "
                   f"({result.worst_param}), tolerance {result.param_tolerance():.0e}; first-step "
                   f"gradients: max error {result.max_grad_error:.2e} of the largest ({result.worst_grad}), "
                   f"tolerance {result.tolerance['grad_rtol']:.0e}; dropout off in both runs; "
                   f"{result.seconds:.1f}s  ")
    return Group(table, drift + summary + verdict)
