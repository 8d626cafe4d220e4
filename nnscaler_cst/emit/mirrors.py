"""Models in several files: each rewritten class goes into a mirror of its source file.

A model whose classes live in several files (timm's blocks in `timm/layers/*`, torchtitan's
model and attention modules, a user's own package) is written out as mirrors: a file of the
output at the package-relative path of its source (`parallel/timm/layers/attention.py` for
`timm.layers.attention`) holding only the top-level classes and functions of that file that
must change, everything else imported from the installed module unchanged.

What must change, per file:
- a definition the rewrite changed (its text differs after the edits);
- a definition of the model that refers by name to one that must change, so that it builds
  or calls the rewritten one: a class of a module in the model (`Block` constructing
  `Attention`, also through a default argument `attn_layer=Attention`), a function that ran
  in the traced step, a module-level assignment (`ATTENTION_CLASSES = {...}`) such a
  definition reads.
A name a mirrored definition reads is imported from the mirror that defines it anew, or else
from the installed module where the original file bound it (modules, helpers, constants,
whatever the original's own imports and try/except fallbacks bound). Mirrors import each other
and `_comm` by relative imports, so the output folder stays one package. A relative import
inside a kept definition (diffusers' `from .normalization import RMSNorm` in a constructor, to
avoid a circular import) is resolved against the source's package: it names the mirror when
that mirror defines every name it imports, else the installed module.

A rewritten class is a new class object: where the library looks classes up by identity in
tables of its own (timm's `norm_layer in _NORM_ACT_TYPES`), the mirror adds it to each
module-level set, list or class-keyed dict of the package that holds the installed class, so
the library's lookup finds both (the rewritten class named by mirrored code, the installed one
handed by a registered builder that is not defined again).

Decides and renders text; rewrites no model logic (emit/rewrite.py does) and writes no file.
"""
from __future__ import annotations

import importlib.util
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import GlobalScope, ScopeProvider

from ..errors import UserError, display_path
from ..source.files import SourceFile, resolved

_DEFS = (cst.ClassDef, cst.FunctionDef)
_PACKAGE_GLOBALS = ("torch", "importlib")     # modules the output's __init__.py imports


@dataclass
class Mirror:
    """One mirrored file: its source, its module's name as imported, and what it holds."""

    source: SourceFile
    module_name: str                      # `timm.layers.attention`
    rewritten: cst.Module                 # the whole file after the edits
    members: list[int] = field(default_factory=list)    # indices of the top-level statements kept
    reads: dict[int, set[str]] = field(default_factory=dict)    # per statement, the global names it reads

    @property
    def out_name(self) -> str:
        """The path in the output folder: the module's dotted name as folders. The output's
        package module imports torch and importlib: a mirror package of that name would become
        the package's attribute, in their place (`_torch/nn/modules/transformer.py`)."""
        parts = self.module_name.split(".")
        if parts[0] in _PACKAGE_GLOBALS:
            parts[0] = f"_{parts[0]}"
        if Path(self.source.path).name == "__init__.py":
            parts.append("__init__")
        return "/".join(parts) + ".py"

    @property
    def depth(self) -> int:
        """Dots of a relative import from this file up to the output folder's package."""
        return len(self.out_name.split("/"))

    def relative(self, other: "Mirror") -> str:
        """The relative module name of `other` as this mirror imports it (`.attention`)."""
        package = self.out_name.split("/")[:-1]
        target = other.out_name[:-3].split("/")
        if target[-1] == "__init__":
            target = target[:-1]
        common = 0
        while common < min(len(package), len(target) - 1) and package[common] == target[common]:
            common += 1
        return "." * (len(package) - common + 1) + ".".join(target[common:])


def _module_of(path: str) -> tuple[str, types.ModuleType]:
    """The dotted name and module object a source file was imported as."""
    wanted = resolved(path)
    for name, module in sorted(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not name.startswith("_nnscaler_entry_") and name != "__main__" \
                and resolved(file) == wanted:
            return name, module
    raise UserError(f"{display_path(path)} holds classes of the model but was not imported as a module",
                    hint="import the model's files as modules of a package (`from mypkg.blocks import Block`)")


def _statement_name(stmt: cst.CSTNode) -> list[str]:
    """The names a top-level statement binds: a def's name, an assignment's plain targets."""
    if isinstance(stmt, _DEFS):
        return [stmt.name.value]
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign):
            return [t.target.value for t in small.targets if isinstance(t.target, cst.Name)]
        if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value is not None:
            return [small.target.value]
    return []


def statement_lines(source: SourceFile, stmt: cst.CSTNode) -> tuple[int, int]:
    """The first and last line of a top-level statement, its decorators included (LibCST's
    position of a def starts at `def`)."""
    where = source.positions[stmt]
    decorators = getattr(stmt, "decorators", ())
    first = source.positions[decorators[0]].start.line if decorators else where.start.line
    return first, where.end.line


def _global_reads(source: SourceFile) -> dict[int, set[str]]:
    """Per top-level statement (by index), the module-level or builtin names its code reads."""
    scopes = source.wrapper.resolve(ScopeProvider)
    positions = source.positions
    ranges = []
    for index, stmt in enumerate(source.module.body):
        first, _ = statement_lines(source, stmt)
        where = positions[stmt]
        ranges.append(((first, 0), (where.end.line, where.end.column), index))
    reads: dict[int, set[str]] = {index: set() for index in range(len(source.module.body))}
    seen = set()
    for scope in set(scopes.values()):
        if scope is None or id(scope) in seen:
            continue
        seen.add(id(scope))
        for access in scope.accesses:
            if access.referents and not all(isinstance(r.scope, GlobalScope) for r in access.referents):
                continue        # a local, a parameter, a closure variable
            node = access.node
            while isinstance(node, cst.Attribute):     # `collections.abc.X` after `import collections.abc`
                node = node.value
            if node not in positions or not isinstance(node, cst.Name):
                continue
            start = positions[node].start
            at = (start.line, start.column)
            for first, last, index in ranges:
                if first <= at < last:
                    reads[index].add(node.value)
                    break
    return reads


def _decorated_function(stmt: cst.CSTNode) -> bool:
    """A decorated top-level function: defined again, its decorators would run again (a model
    registry refuses a second entry), so it is mirrored only when the rewrite changes it; its
    callers use the installed one (build() turns the library classes it constructs into the
    rewritten ones)."""
    return isinstance(stmt, cst.FunctionDef) and bool(stmt.decorators)


def library_decorated(original: cst.Module, rewritten: cst.Module, module_name: str) -> tuple[cst.Module, list[int]]:
    """A library file copied whole into a rank file: each decorated top-level function the rewrite
    did not change is imported from the installed module instead of defined again. Returns the
    file, and the indices of the top-level statements so imported."""
    body, imported = [], []
    for index, (old, new) in enumerate(zip(original.body, rewritten.body)):
        if _decorated_function(old) and old.deep_equals(new):
            name = old.name.value
            new = cst.parse_statement(f"from {module_name} import {name}  # decorated: the installed one, its "
                                      "decorators not run again\n").with_changes(leading_lines=new.leading_lines)
            imported.append(index)
        body.append(new)
    return rewritten.with_changes(body=body), imported


def _definition_key(value) -> tuple[str, str] | None:
    """(resolved file, top-level name) of a class or function defined at a file's top level."""
    if not isinstance(value, (type, types.FunctionType)):
        return None
    qualname = getattr(value, "__qualname__", "")
    module = sys.modules.get(getattr(value, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    if "." in qualname or not isinstance(file, str):
        return None
    return resolved(file), qualname


def plan_mirrors(rewritten: dict[str, tuple[SourceFile, cst.Module]], model_classes: set[type],
                 traced_lines: dict[str, set[int]]) -> list[Mirror]:
    """Which top-level statements of each file go into its mirror (see the module docstring).

    `rewritten`: resolved path -> (the file, the file after the edits); `model_classes`: the
    classes of the model's modules; `traced_lines`: resolved path -> lines a traced op ran at.
    Files with nothing to mirror are left out."""
    mirrors: dict[str, Mirror] = {}
    library: dict[str, types.ModuleType] = {}
    for path, (source, module) in rewritten.items():
        if len(module.body) != len(source.module.body):
            raise UserError("internal error: the rewrite changed the top-level statements of a mirrored file",
                            hint="please report it")
        name, library[path] = _module_of(path)
        mirrors[path] = Mirror(source, name, module, reads=_global_reads(source))
    # every candidate statement: (path, index) -> (names it binds, the definitions it reads)
    changed: set[tuple[str, int]] = set()
    candidate: set[tuple[str, int]] = set()
    reads: dict[tuple[str, int], set[tuple[str, str]]] = {}
    binds: dict[tuple[str, str], tuple[str, int]] = {}
    model_keys = {_definition_key(cls) for cls in model_classes}
    for path, mirror in mirrors.items():
        source, namespace = mirror.source, vars(library[path])
        file_reads = mirror.reads
        for index, (old, new) in enumerate(zip(source.module.body, mirror.rewritten.body)):
            names = _statement_name(old)
            for name in names:
                binds[(path, name)] = (path, index)
            if not names:
                continue
            key = (path, index)
            if not old.deep_equals(new):
                changed.add(key)
            first, last = statement_lines(source, old)
            ran = any(first <= line <= last for line in traced_lines.get(path, ()))
            if isinstance(old, cst.ClassDef) and (path, names[0]) in model_keys or ran and not _decorated_function(old) \
                    or not isinstance(old, _DEFS):
                candidate.add(key)
            reads[key] = set()
            for read in file_reads[index]:
                if read in namespace:
                    target = _definition_key(namespace[read]) or (path, read)
                    reads[key].add(target)
    kept = set(changed)
    grown = True
    while grown:        # definitions that name a kept one are kept: they must build or call it
        grown = False
        for key in candidate - kept:
            if any(binds.get(target) in kept for target in reads[key]):
                kept.add(key)
                grown = True
    for path, index in sorted(kept):
        mirrors[path].members.append(index)
    return [m for m in mirrors.values() if m.members]


def render_mirror(mirror: Mirror, mirrors: list[Mirror], comm_names: set[str], needs_torch: bool,
                  original: bool = False, variants: dict[str, list[cst.ClassDef]] | None = None) -> str:
    """The mirror's text: a note, its imports (from the installed module, from other mirrors,
    from `_comm`), then its kept statements in their order in the source, each kept class
    followed by its `variants` (emit/variants.py); with `original`, as they are in the source
    (the base --diff compares the mirror with)."""
    namespace = vars(sys.modules[mirror.module_name])
    by_key = {(resolved(str(m.source.path)), _statement_name(m.source.module.body[i])[0]): m
              for m in mirrors for i in m.members if _statement_name(m.source.module.body[i])}
    own = {name for i in mirror.members for name in _statement_name(mirror.source.module.body[i])}
    reads = mirror.reads
    needed = sorted({name for i in mirror.members for name in reads[i]} - own)
    from_library, from_mirrors = [], {}
    for name in needed:
        if name not in namespace:
            continue                     # a builtin
        key = _definition_key(namespace[name])
        other = by_key.get(key) if key is not None else None
        if other is not None and other is not mirror:
            from_mirrors.setdefault(mirror.relative(other), []).append(
                name if key[1] == name else f"{key[1]} as {name}")
        elif other is None:
            from_library.append(name)
    future = [s for s in mirror.source.module.body if isinstance(s, cst.SimpleStatementLine)
              and isinstance(s.body[0], cst.ImportFrom) and isinstance(s.body[0].module, cst.Name)
              and s.body[0].module.value == "__future__"]
    note = (f"Mirror of {mirror.module_name.replace('.', '/')}.py (module {mirror.module_name}): the definitions "
            "the plan rewrites, and those that build or call them; everything else is the installed module's, "
            "imported unchanged.")
    lines = [f"# {line}" for line in textwrap.wrap(note, 98, break_on_hyphens=False)]
    code = cst.Module([])
    lines += [code.code_for_node(s).strip() for s in future]
    if needs_torch and "torch" not in from_library:
        lines.append("import torch")
    if from_library:
        lines.append(_import_line(mirror.module_name, from_library))
    for module, names in sorted(from_mirrors.items()):
        lines.append(_import_line(module, names))
    if comm_names:
        lines.append(_import_line(f"{'.' * mirror.depth}_comm", sorted(comm_names)))
    module = mirror.source.module if original else mirror.rewritten
    body = [module.body[i] for i in mirror.members]
    if not original:
        body = [stmt.visit(_InnerImports(mirror, mirrors)) for stmt in body]
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    if not original:
        body = [s for stmt in body for s in [stmt, *(variants or {}).get(getattr(stmt, "name", None) and
                                                                          stmt.name.value, [])]]
    text = "\n".join(lines) + "\n" + module.with_changes(body=body, header=[], footer=[]).code
    return text if original else text + _table_entries(mirror)


def _identity_tables(mirror: Mirror) -> list[tuple[str, str, object, str]]:
    """(module, name, table, class name) of each module-level set, list or class-keyed dict of
    the mirrored module's package that holds the installed class of a class the mirror defines
    anew. The library looks classes up there by identity (timm's get_norm_act_layer:
    `norm_layer in _NORM_ACT_TYPES`), handed the rewritten class by the mirrored code or the
    installed one by the library's own (a registered builder): both must be found."""
    library = sys.modules[mirror.module_name]
    classes = {}
    for index in mirror.members:
        stmt = mirror.source.module.body[index]
        value = getattr(library, stmt.name.value, None) if isinstance(stmt, cst.ClassDef) else None
        if isinstance(value, type):
            classes[id(value)] = stmt.name.value
    if not classes:
        return []
    top = mirror.module_name.partition(".")[0]
    found, seen = [], set()
    with warnings.catch_warnings():     # reading a deprecated module attribute warns (torch.distributed)
        warnings.simplefilter("ignore")
        modules = sorted(sys.modules.items())
        tables = [(name, attr, table) for name, module in modules if isinstance(module, types.ModuleType)
                  and (name == top or name.startswith(top + ".")) for attr, table in sorted(vars(module).items())
                  if not attr.startswith("__") and isinstance(table, (set, list, dict))]
    for name, attr, table in tables:
        if id(table) in seen:
            continue
        held = sorted({classes[id(item)] for item in table if id(item) in classes})
        if held:
            seen.add(id(table))
            found += [(name, attr, table, cls) for cls in held]
    return found


def _table_entries(mirror: Mirror) -> str:
    """The lines that put each rewritten class into the library's tables beside its installed
    class (_identity_tables), or nothing."""
    tables = _identity_tables(mirror)
    if not tables:
        return ""
    lines = ["", "", "# The installed library looks these classes up by identity in its own tables: they hold the",
             "# rewritten classes too, beside the installed ones.", "import importlib", ""]
    for module, attr, table, cls in tables:
        where = f'importlib.import_module("{module}").{attr}'
        if isinstance(table, set):
            lines.append(f"{where}.add({cls})")
        elif isinstance(table, list):
            lines.append(f"{where}.append({cls})")
        else:
            lines.append(f'{where}[{cls}] = {where}[importlib.import_module("{mirror.module_name}").{cls}]')
    return "\n".join(lines) + "\n"


class _InnerImports(cst.CSTTransformer):
    DESCRIPTION = "Resolve a kept definition's relative imports: the mirror's package is not the source's."

    def __init__(self, mirror: Mirror, mirrors: list[Mirror]):
        super().__init__()
        self.mirror = mirror
        self.by_module = {m.module_name: m for m in mirrors}

    def leave_ImportFrom(self, original, updated):
        if not updated.relative:
            return updated
        name = self.mirror.module_name
        package = name if Path(self.mirror.source.path).name == "__init__.py" else name.rpartition(".")[0]
        tail = cst.Module([]).code_for_node(updated.module) if updated.module else ""
        target = importlib.util.resolve_name("." * len(updated.relative) + tail, package)
        other = self.by_module.get(target)
        if other is not None and not isinstance(updated.names, cst.ImportStar):
            own = {bound for i in other.members for bound in _statement_name(other.source.module.body[i])}
            if all(alias.evaluated_name in own for alias in updated.names):
                relative = self.mirror.relative(other)
                tail = relative.lstrip(".")
                return updated.with_changes(relative=[cst.Dot()] * (len(relative) - len(tail)),
                                            module=cst.parse_expression(tail) if tail else None)
        return updated.with_changes(relative=[], module=cst.parse_expression(target))


def _import_line(module: str, names: list[str]) -> str:
    """`from module import a, b`, wrapped in parentheses past 100 columns."""
    line = f"from {module} import {', '.join(names)}"
    if len(line) <= 100:
        return line
    wrapped = textwrap.wrap(", ".join(names) + ",", 96, break_on_hyphens=False)
    return f"from {module} import (\n" + "".join(f"    {part}\n" for part in wrapped) + ")"
