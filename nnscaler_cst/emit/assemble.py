"""Assemble one rank's model file: the rewritten model source, plus the entry file's
functions when the model lives in a package, with imports made to work from the output.

Text-level assembly of LibCST modules; rewrites no model logic.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import libcst as cst

from .. import __version__
from ..errors import UserError, display_path


def module_name_of(path: Path) -> str | None:
    """The importable dotted name of a file, from sys.modules (None for a loose script)."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path.resolve() and not name.startswith("_nnscaler_entry_"):
            return name
    return None


class AbsoluteImports(cst.CSTTransformer):
    DESCRIPTION = "Make `from .x import y` absolute, so the file works from the output folder."

    def __init__(self, package: str):
        super().__init__()
        self.package = package

    def leave_ImportFrom(self, original, updated):
        if not updated.relative:
            return updated
        dots = "." * len(updated.relative)
        tail = cst.Module([]).code_for_node(updated.module) if updated.module else ""
        absolute = importlib.util.resolve_name(dots + tail, self.package)
        return updated.with_changes(relative=[], module=cst.parse_expression(absolute))


class DropImportedNames(cst.CSTTransformer):
    DESCRIPTION = "Drop imports of names the merged file now defines itself."

    def __init__(self, defined: set[str]):
        super().__init__()
        self.defined = defined

    def leave_ImportFrom(self, original, updated):
        if isinstance(updated.names, cst.ImportStar):
            return updated
        kept = [a for a in updated.names if (a.evaluated_alias or a.evaluated_name) not in self.defined]
        if not kept:
            return cst.RemovalSentinel.REMOVE
        if len(kept) != len(updated.names):
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(names=kept)
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemovalSentinel.REMOVE if not updated.body else updated


def _defined_names(module: cst.Module) -> set[str]:
    names = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            names.add(stmt.name.value)
    return names


def merge_entry(model: cst.Module, model_path: Path, entry: cst.Module, entry_path: Path) -> cst.Module:
    """The model file followed by the entry file's own code (build(), example_inputs(), ...)."""
    package = (module_name_of(model_path) or "").rpartition(".")[0]
    if package:
        model = model.visit(AbsoluteImports(package))
    entry = entry.visit(DropImportedNames(_defined_names(model)))
    present = {cst.Module([]).code_for_node(stmt).strip() for stmt in model.body
               if isinstance(stmt, cst.SimpleStatementLine)}
    entry = entry.with_changes(body=[stmt for stmt in entry.body if not (
        isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom))
        and cst.Module([]).code_for_node(stmt).strip() in present)])
    header = cst.EmptyLine(comment=cst.Comment(f"# --- entry file {display_path(entry_path)}: "
                                               "build(), example_inputs() ---"))
    body = list(entry.body)
    if body:
        body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), header,
                                                      *body[0].leading_lines])
    return model.with_changes(body=[*model.body, *body])


def add_comm_import(module: cst.Module, names: set[str], needs_torch: bool) -> cst.Module:
    """`from ._comm import TP, tp_copy` (and `import torch`) after the file's first imports."""
    lines = []
    if needs_torch and "import torch\n" not in module.code:
        lines.append(cst.parse_statement("import torch\n"))
    if names:
        lines.append(cst.parse_statement(f"from ._comm import {', '.join(sorted(names))}\n"))
    if not lines:
        return module
    body = list(module.body)
    position = 0
    for k, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
            position = k + 1
        elif isinstance(stmt, cst.SimpleStatementLine) and k == 0 and isinstance(
                stmt.body[0], cst.Expr) and isinstance(stmt.body[0].value, cst.SimpleString):
            position = 1        # after the module docstring
        elif position:
            break
    return module.with_changes(body=body[:position] + lines + body[position:])


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def with_header(text: str, description: str) -> str:
    """Prefix the @generated line; its hash covers everything after it, so edits show."""
    return f"# @generated by nnscaler-rewrite {__version__} {description}; sha256:{content_hash(text)}\n{text}"


def read_header(text: str) -> tuple[str, str] | None:
    """(recorded hash, hash of the body as it is now) of a generated file, or None."""
    first, _, body = text.partition("\n")
    if "@generated by nnscaler-rewrite" not in first or "sha256:" not in first:
        return None
    return first.rsplit("sha256:", 1)[1].strip(), content_hash(body)


def model_files(own_files: list[str], entry_path: Path) -> tuple[Path | None, Path]:
    """(the package model file, or None when the entry defines the model; the entry file)."""
    others = sorted({str(Path(p).resolve()) for p in own_files} - {str(entry_path.resolve())})
    if len(others) > 1:
        raise UserError("the model's classes come from several files: " +
                        ", ".join(display_path(p) for p in others),
                        hint="models spread over several source files are not supported yet")
    return (Path(others[0]) if others else None), entry_path
