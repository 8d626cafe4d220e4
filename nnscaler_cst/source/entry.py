"""Load the user's entry file and its model convention: build(), example_inputs(), loss().

The entry file either defines the model or imports it from a package. This module imports
and calls the user's code; it does not trace or rewrite it. It notes, for every module of the
model build() returns, the call that constructed it (`Entry.constructions`): in the entry file
(`transformers.LlamaForCausalLM(config)`) or inside a factory (`from_config`, a registry).
"""
from __future__ import annotations

import functools
import importlib.util
import linecache
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from ..errors import Location, UserError, display_path
from .files import SourceSet


@dataclass(frozen=True)
class Construction:
    """The call `cls(...)` that constructed one module of the model, written at `file`.

    Lines are 1-based, columns 0-based characters, ends exclusive (co_positions, in characters).
    `file` is the resolved path, None when no Python frame made the call. `entry_line` and
    `entry_col` give the innermost call of the entry file on the way to it (a factory call such
    as `AutoModelForCausalLM.from_config(config)`), 0 when the entry file was not on the way.
    `route` gives (resolved file, line) of each frame between the two, innermost first: the code
    on the way, which decides whose class the call names (a library function the output imports
    rather than defines anew calls the installed class).
    """

    cls: type
    file: str | None = None
    line: int = 0
    col: int = 0
    end_line: int = 0
    end_col: int = 0
    entry_line: int = 0
    entry_col: int = 0
    route: tuple[tuple[str, int], ...] = ()


@dataclass
class Entry:
    path: Path
    module: ModuleType
    build_fn: Callable[[], torch.nn.Module]
    example_inputs: Callable[[], Any]
    loss_fn: Callable[[Any], torch.Tensor] | None
    # module path in the model ("" for the model itself) -> the call that constructed it, as
    # the last build() saw it
    constructions: dict[str, Construction] = field(default_factory=dict)

    def build(self) -> torch.nn.Module:
        """The user's build(), noting where each module of the model it returns was constructed."""
        sites: dict[int, Construction] = {}
        module_init = torch.nn.Module.__init__

        def noting_init(module, *args, **kwargs):
            sites[id(module)] = _constructing_call(module, sys._getframe(1), str(self.path))
            module_init(module, *args, **kwargs)

        torch.nn.Module.__init__ = noting_init
        try:
            model = self.build_fn()
        finally:
            torch.nn.Module.__init__ = module_init
        if not isinstance(model, torch.nn.Module):
            raise UserError(f"build() returned {type(model).__name__}, not an nn.Module", self._build_location(),
                            hint="build() returns the model: `def build(): return MyModel(...)`")
        self.constructions = {name: sites.get(id(m)) or Construction(type(m))
                              for name, m in model.named_modules()}
        lazy = [name for name, p in model.named_parameters()
                if isinstance(p, torch.nn.parameter.UninitializedParameter)]
        if lazy:
            raise UserError(f"build() returned a model whose lazy layers are not initialised yet ({lazy[0]}"
                            + (f" and {len(lazy) - 1} more" if len(lazy) > 1 else "") + "): their sizes are "
                            "known only after a first call", self._build_location(),
                            hint="call the model once on an example batch inside build(), as torch's lazy "
                                 "modules ask, or build those layers with their input sizes")
        return model

    def _build_location(self) -> Location:
        code = getattr(self.build_fn, "__code__", None)
        return Location(display_path(code.co_filename), code.co_firstlineno) if code \
            else Location(display_path(self.path))

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
        raise UserError("the model output is not a scalar loss and has no `.loss` nor a \"loss\" key",
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


def _constructing_call(module: torch.nn.Module, frame, entry_file: str) -> Construction:
    """The call `cls(...)` that is constructing `module`: the first frame, going out from
    nn.Module.__init__, that is not an `__init__` of `module` itself."""
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_code.co_argcount and \
            frame.f_locals.get(frame.f_code.co_varnames[0]) is module:
        frame = frame.f_back
    if frame is None:
        return Construction(type(module))
    line, col, end_line, end_col = _position(frame)
    via, route = frame, []
    while via is not None and via.f_code.co_filename != entry_file:
        if via is not frame:
            route.append((_resolved(via.f_code.co_filename), via.f_lineno or 0))
        via = via.f_back
    entry_line, entry_col = _position(via)[:2] if via is not None else (0, 0)
    return Construction(type(module), _resolved(frame.f_code.co_filename), line, col, end_line, end_col,
                        entry_line, entry_col, tuple(route) if via is not None else ())


_POSITIONS: dict[int, tuple] = {}   # id(code) -> (code, its co_positions()): kept alive, so ids stay unique


def instruction_position(frame) -> tuple | None:
    """co_positions() of the instruction a frame is at (bytes), or None."""
    code = frame.f_code
    known = _POSITIONS.get(id(code))
    if known is None:                   # listing them is a pass over the whole function's bytecode
        known = _POSITIONS[id(code)] = (code, list(code.co_positions()))
    positions = known[1]
    index = frame.f_lasti // 2
    return positions[index] if 0 <= index < len(positions) else None


def _position(frame) -> tuple[int, int, int, int]:
    """(line, col, end line, end col) of the instruction a frame is at, columns in characters."""
    filename = frame.f_code.co_filename
    line, end_line, col, end_col = instruction_position(frame) or (None,) * 4
    if line is None or end_line is None or col is None or end_col is None:
        return frame.f_lineno or 0, 0, 0, 0
    return line, _char_col(filename, line, col), end_line, _char_col(filename, end_line, end_col)


@functools.lru_cache(maxsize=None)
def _resolved(filename: str) -> str:
    return str(Path(filename).resolve())


def _char_col(filename: str, line: int, byte_col: int) -> int:
    """A UTF-8 byte offset within a line (what co_positions gives) in characters."""
    text = linecache.getline(filename, line)
    return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore")) if text else byte_col


def load_entry(path: str | Path, sources: SourceSet, model_class: str | None = None) -> Entry:
    path = Path(path).resolve()
    if path.is_dir():
        raise UserError(f"{display_path(path)} is a folder, not a model file",
                        hint="pass the model file: nnscaler-rewrite model.py")
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
    folder = str(path.parent)
    if folder not in sys.path:      # as `python model.py` would: its sibling files import
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as exc:  # the user's module failed at import time
        loc = user_frame_location(exc, {str(path)}) or Location(display_path(path))
        raise UserError(f"importing the model file failed: {type(exc).__name__}: {exc}", loc,
                        hint="the file must import cleanly with only torch and its own dependencies") from exc
    return module
