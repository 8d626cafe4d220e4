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
    if result.precision in ("bf16", "fp16"):
        drift += Text(f"the reference computes in {result.precision} (its parameters or its autocast): "
                      f"tolerances for its rounding\n")
    summary = Text(_errors(result) + f"; dropout off in both runs; {result.seconds:.1f}s  ")
    wide = result.float64
    if wide is not None:
        outcome = "within" if wide.passed_as_run else "NOT within"
        drift += Text(f"float32 differs past its tolerances; with both runs in float64 (tolerances "
                      f"{wide.tolerance['grad_rtol'] / result.tolerance['grad_rtol']:g}x float32's) the losses differ "
                      f"by at most {max(wide.loss_errors, default=0.0):.2e}, and {_errors(wide)}: {outcome} "
                      "tolerance" + (", so the float32 difference is rounding the model amplifies\n"
                                     if wide.passed_as_run else "\n"))
    return Group(table, drift + summary + verdict)


def _errors(result: VerifyResult) -> str:
    return (f"merged parameters after the last step: max abs error {result.max_abs_error:.2e} "
            f"({result.worst_param}), tolerance {result.param_tolerance():.0e}; first-step "
            f"gradients: max error {result.max_grad_error:.2e} of the largest ({result.worst_grad}), "
            f"tolerance {result.tolerance['grad_rtol']:.0e}" +
            (f"; buffers after the first forward: max error {result.max_buffer_error:.2e} of the largest "
             f"({result.worst_buffer})" if result.worst_buffer else ""))
