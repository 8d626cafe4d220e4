"""Modules the generated programs import from the model's own folder.

A model file may import a helper module that sits beside it (`from utils import rotate_half`)
and that the rewrite leaves as it is: the programs import it by the same name. The output
does not copy it, so a rank finds it only when the model's folder is on its path: always
when the output is written beside the model (train.py puts the output's parent first), else
with PYTHONPATH naming the model's folder, which verify gives its ranks.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

from ..errors import display_path

PROGRAM_SUPPORT = {"__init__.py", "_comm.py", "train.py"}


def modules_beside(files: dict[str, str], folder: Path) -> list[str]:
    """Top-level modules the program files import that were loaded from `folder`."""
    folder = folder.resolve()
    names: set[str] = set()
    for name, text in files.items():
        if not name.endswith(".py") or name in PROGRAM_SUPPORT:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return sorted(n for n in names if _loaded_from(n, folder))


def _loaded_from(name: str, folder: Path) -> bool:
    path = getattr(sys.modules.get(name), "__file__", None)
    return path is not None and folder in Path(path).resolve().parents


def beside_warning(files: dict[str, str], model_file: Path, out_dir: Path) -> str | None:
    """A warning when the programs import modules from the model's folder and the output is
    written elsewhere: how to run it."""
    folder = Path(model_file).resolve().parent
    if Path(out_dir).resolve().parent == folder:
        return None
    names = modules_beside(files, folder)
    if not names:
        return None
    shown = display_path(folder)
    return (f"{display_path(out_dir)}: warning: the programs import {', '.join(names)} from {shown}, which the "
            f"output does not hold; run them with PYTHONPATH={shown} (verify does), or write the output beside "
            f"the model (-o {display_path(folder / 'parallel')})")
