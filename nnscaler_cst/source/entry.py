"""Load the user's entry file and its model convention: build(), example_inputs(), loss().

The entry file either defines the model or imports it from a package. This module imports
and calls the user's code; it does not trace or rewrite it.
"""
from __future__ import annotations

import importlib.util
import linecache
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from ..errors import Location, UserError, display_path
from .files import SourceSet


@dataclass
class Entry:
    path: Path
    module: ModuleType
    build: Callable[[], torch.nn.Module]
    example_inputs: Callable[[], Any]
    loss_fn: Callable[[Any], torch.Tensor] | None

    def call_model(self, model: torch.nn.Module, inputs: Any) -> Any:
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar to train on: loss(output), else the output if scalar, else output.loss."""
        if self.loss_fn is not None:
            return self.loss_fn(output)
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return output
        value = getattr(output, "loss", None)
        if value is None and isinstance(output, dict):
            value = output.get("loss")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            return value
        raise UserError("the model output is not a scalar loss and has no `.loss`",
                        Location(display_path(self.path)),
                        hint="define `def loss(output): return <scalar tensor>` in the entry file")


def user_frame_location(exc: BaseException, files: set[str]) -> Location | None:
    """The innermost traceback frame that lies in one of `files` (resolved paths)."""
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) in files:
            # colno is a UTF-8 byte offset (from co_positions); Location wants characters
            line = linecache.getline(frame.filename, frame.lineno or 1)
            col = len(line.encode("utf-8")[:frame.colno or 0].decode("utf-8", errors="ignore"))
            found = Location(display_path(frame.filename), frame.lineno or 1, col)
    return found


def load_entry(path: str | Path, sources: SourceSet, model_class: str | None = None) -> Entry:
    path = Path(path).resolve()
    if not path.is_file():
        raise UserError(f"no such file: {path}", hint="pass the model file: nnscaler-rewrite model.py")
    sources.get(path)  # a syntax error is reported with its position before anything runs
    module = _import_file(path)
    shown = display_path(path)

    build = getattr(module, "build", None)
    if model_class is not None:
        cls = getattr(module, model_class, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise UserError(f"`{model_class}` is not an nn.Module class in this file", Location(shown),
                            hint="--model names a class defined or imported in the model file")
        build = build or cls
    if not callable(build):
        raise UserError("the model file defines no `build()`", Location(shown),
                        hint="add `def build(): return MyModel(...)` returning the nn.Module, "
                             "or pass --model ClassName")
    example_inputs = getattr(module, "example_inputs", None)
    if not callable(example_inputs):
        raise UserError("the model file defines no `example_inputs()`", Location(shown),
                        hint="add `def example_inputs(): return (x,)` (positional) or "
                             "`return {'input_ids': ids}` (keyword inputs)")
    loss_fn = getattr(module, "loss", None)
    return Entry(path, module, build, example_inputs, loss_fn if callable(loss_fn) else None)


def _import_file(path: Path) -> ModuleType:
    name = f"_nnscaler_entry_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as exc:  # the user's module failed at import time
        loc = user_frame_location(exc, {str(path)}) or Location(display_path(path))
        raise UserError(f"importing the model file failed: {type(exc).__name__}: {exc}", loc,
                        hint="the file must import cleanly with only torch and its own dependencies") from exc
    return module
