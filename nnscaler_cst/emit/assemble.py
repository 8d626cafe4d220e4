"""Assemble one rank's model file: the rewritten model source, plus the entry file's
functions when the model lives in a package, with imports made to work from the output.

The entry file's code, appended to the rewritten modeling file, must construct the rewritten
classes however it names the library's: `from transformers import LlamaForCausalLM`,
`transformers.LlamaForCausalLM`, an alias, `tf.models.llama.modeling_llama.LlamaForCausalLM`,
a registry of classes. Every expression of the entry file whose value (in the entry module as
it ran) *is* one of the library's objects the rewritten file defines anew is made to name the
rewritten one. A model build() reaches through a factory (`AutoModelForCausalLM.from_config`,
a registry function elsewhere) or a class held in a value (`config.norm_class(...)` in the
library's code) -- the trace saw the call constructing it, and it names no rewritten class -- is built with a wrapper that makes constructing the library class construct the
rewritten one while build() runs.

Text-level assembly of LibCST modules; rewrites no model logic.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import textwrap
import types
from pathlib import Path

import libcst as cst
from libcst.metadata import (ExpressionContext, ExpressionContextProvider, GlobalScope, MetadataWrapper,
                             PositionProvider, ScopeProvider)

from .. import __version__
from ..errors import Location, UserError, display_path
from ..source.entry import Construction, Entry
from ..source.files import SourceFile, SourceSet, resolved


def module_name_of(path: Path) -> str | None:
    """The importable dotted name of a file, from sys.modules (None for a loose script)."""
    wanted = resolved(str(path))
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and resolved(file) == wanted and not name.startswith("_nnscaler_entry_"):
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


def _bound_name(alias: cst.ImportAlias) -> str:
    """The name an import binds: `import a.b` binds a, `import a.b as c` and `from a import b as c` c."""
    return alias.evaluated_alias or alias.evaluated_name.split(".")[0]


class DropImportedNames(cst.CSTTransformer):
    DESCRIPTION = "Drop imports of names the merged file now defines itself, or that nothing uses any more."

    def __init__(self, defined: set[str], unused: set[str] = frozenset()):
        super().__init__()
        self.defined = defined
        self.unused = unused        # bound names whose every use now names a rewritten object

    def _kept(self, updated, names):
        kept = [a for a in names if (a.evaluated_alias or a.evaluated_name) not in self.defined
                and _bound_name(a) not in self.unused]
        if not kept:
            return cst.RemovalSentinel.REMOVE
        if len(kept) != len(names):
            kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(names=kept)
        return updated

    def leave_ImportFrom(self, original, updated):
        if isinstance(updated.names, cst.ImportStar):
            return updated
        return self._kept(updated, updated.names)

    def leave_Import(self, original, updated):
        return self._kept(updated, updated.names) if self.unused else updated

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemovalSentinel.REMOVE if not updated.body else updated


def _defined_names(module: cst.Module) -> set[str]:
    names = set()
    for stmt in module.body:
        if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
            names.add(stmt.name.value)
    return names


def _library_objects(model_path: Path, defined: set[str]) -> dict[int, tuple[object, str]]:
    """id -> (object, name) of what the library's own module defines under the names the
    rewritten file defines anew: the objects whose uses must name the rewritten ones. (A file
    imported under two names is two modules with objects of their own: both count.)"""
    wanted = resolved(str(model_path))
    modules = [module for name, module in sorted(sys.modules.items())
               if not name.startswith("_nnscaler_entry_") and isinstance(getattr(module, "__file__", None), str)
               and resolved(module.__file__) == wanted]
    found = {}
    for module in modules:
        for name in sorted(defined):
            value = getattr(module, name, None)
            if isinstance(value, (type, types.FunctionType)):
                found[id(value)] = (value, name)
    return found


class NameRewritten(cst.CSTTransformer):
    """Make each expression whose value is one of the library's objects name the rewritten one.

    `transformers.LlamaForCausalLM`, `tf.models.llama.modeling_llama.LlamaForCausalLM` and an
    alias `L` all become `LlamaForCausalLM`, the class the merged file defines. An expression is
    evaluated only as far as a chain of module-level names and attributes of modules and
    classes (what the entry file's import bound), in the entry module as it ran.
    """

    METADATA_DEPENDENCIES = (ScopeProvider, ExpressionContextProvider, PositionProvider)

    def __init__(self, namespace: dict, library: dict[int, tuple[object, str]], entry_path: Path):
        super().__init__()
        self.namespace = namespace
        self.library = library
        self.entry_path = entry_path
        self.loads: dict[str, int] = {}           # module-level name -> uses left in the code
        self.renamed: dict[str, int] = {}         # module-level name -> uses now naming a rewritten object
        self.resolved_calls: dict[tuple[int, int], object] = {}   # (end line, end col) of a call -> its callee
        self.named: set[str] = set()              # the rewritten names the code now refers to

    _MISSING = object()

    def _value(self, node: cst.BaseExpression):
        """The value of a module-level name or attribute chain, or _MISSING."""
        if isinstance(node, cst.Name):
            if self.get_metadata(ExpressionContextProvider, node, None) != ExpressionContext.LOAD:
                return self._MISSING
            scope = self.get_metadata(ScopeProvider, node, None)
            if scope is None:
                return self._MISSING
            assignments = scope[node.value]
            if not assignments or not all(isinstance(a.scope, GlobalScope) for a in assignments):
                return self._MISSING
            return self.namespace.get(node.value, self._MISSING)
        if isinstance(node, cst.Attribute):
            owner = self._value(node.value)
            if not isinstance(owner, (types.ModuleType, type)):
                return self._MISSING
            try:
                return getattr(owner, node.attr.value)
            except Exception:       # a lazy module that fails to import a name, a property
                return self._MISSING
        return self._MISSING

    def _root(self, node: cst.BaseExpression) -> str | None:
        while isinstance(node, cst.Attribute):
            node = node.value
        return node.value if isinstance(node, cst.Name) else None

    def _rewritten(self, original: cst.BaseExpression, updated: cst.BaseExpression):
        value = self._value(original)
        hit = self.library.get(id(value)) if value is not self._MISSING else None
        if hit is None or hit[0] is not value:
            return updated
        name = hit[1]
        scope = self.get_metadata(ScopeProvider, original, None)
        if scope is not None and any(not isinstance(a.scope, GlobalScope) for a in scope[name]):
            start = self.get_metadata(PositionProvider, original).start
            raise UserError(f"`{name}` here would name a local variable, not the rewritten `{name}`",
                            Location(display_path(self.entry_path), start.line, start.column),
                            hint=f"rename the local variable `{name}` in the entry file")
        root = self._root(original)
        self.renamed[root] = self.renamed.get(root, 0) + 1
        self.named.add(name)
        if isinstance(updated, cst.Name) and updated.value == name:
            return updated
        return cst.Name(name, lpar=updated.lpar, rpar=updated.rpar)

    def visit_Import(self, node):
        return False

    def visit_ImportFrom(self, node):
        return False

    def leave_Name(self, original, updated):
        if self._value(original) is not self._MISSING:
            self.loads[original.value] = self.loads.get(original.value, 0) + 1
        return self._rewritten(original, updated)

    def leave_Attribute(self, original, updated):
        return self._rewritten(original, updated)

    def leave_Assign(self, original, updated):
        """`TinyMLP = pkg.TinyMLP` has become `TinyMLP = TinyMLP`: nothing left to do."""
        if isinstance(updated.value, cst.Name) and all(
                isinstance(t.target, cst.Name) and t.target.value == updated.value.value for t in updated.targets):
            return cst.RemovalSentinel.REMOVE
        return updated

    def leave_Call(self, original, updated):
        if isinstance(updated.func, cst.Name) and self._value(original.func) is not self._MISSING:
            end = self.get_metadata(PositionProvider, original).end
            self.resolved_calls[(end.line, end.column)] = self._value(original.func)
        return updated

    @property
    def unused(self) -> set[str]:
        """Module-level names used before, none of whose uses is left."""
        return {name for name, count in self.renamed.items() if name and count >= self.loads.get(name, 0)}


def _check_bindings(entry: cst.Module, defined: set[str], namespace: dict,
                    library: dict[int, tuple[object, str]], model_path: Path, entry_path: Path) -> None:
    """Refuse an entry file that binds, at module level, a name the rewritten file defines: in the
    merged file it would replace the rewritten class or function the model's code calls."""
    wrapper = MetadataWrapper(entry)
    positions = wrapper.resolve(PositionProvider)
    scopes = wrapper.resolve(ScopeProvider)
    scope = next((s for s in scopes.values() if isinstance(s, GlobalScope)), None)
    if scope is None:
        return
    for name in sorted(defined):
        for assignment in sorted(scope.assignments[name], key=lambda a: positions[a.node].start.line
                                 if a.node in positions else 0):
            node = assignment.node
            value = namespace.get(name)
            if not isinstance(node, (cst.FunctionDef, cst.ClassDef)) and library.get(id(value)) == (value, name):
                continue            # the library's own object: its uses name the rewritten one
            where = positions.get(node)
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
                where = positions.get(node.name, where)
            elif isinstance(node, (cst.Import, cst.ImportFrom)) and not isinstance(node.names, cst.ImportStar):
                where = next((positions[a] for a in node.names if _bound_name(a) == name), where)
            start = where.start if where is not None else None
            raise UserError(
                f"the entry file binds `{name}`, a name the rewritten {display_path(model_path)} defines; "
                f"in the generated file it would replace the rewritten `{name}`",
                Location(display_path(entry_path), start.line, start.column) if start else
                Location(display_path(entry_path)),
                hint=f"rename `{name}` in the entry file (`import ... as Other{name}` for an import)")


def built_by_code_kept(kept: dict[str, list[tuple[int, int]]], own: set[str], sources: SourceSet):
    """Whether the output's own code constructs a module of the model as the rewritten class, as a
    predicate on its construction: the constructing call, and every frame of the model's files
    (`own`, resolved paths) on the way to it from the entry file, lie in the definitions the output
    holds anew (`kept`: resolved path -> line spans), and the call names the class (see
    names_its_class). A frame of the model's files outside them runs the installed code (a
    decorated registry function the output imports), and what it calls builds the installed
    classes. Frames of other files (torch calling a generator, a decorator's wrapper) only call
    what they were handed."""
    modules: dict[str, types.ModuleType | None] = {}

    def inside(file: str, line: int) -> bool:
        return any(first <= line <= last for first, last in kept.get(file, ()))

    def module(file: str) -> types.ModuleType | None:
        if file not in modules:
            name = module_name_of(Path(file))
            modules[file] = sys.modules.get(name) if name is not None else None
        return modules[file]

    def built(construction) -> bool:
        return construction.file is not None and inside(construction.file, construction.line) and all(
            inside(file, line) for file, line in construction.route if file in own) and names_its_class(
            sources.get(construction.file), module(construction.file), construction)
    return built


def names_its_class(source: SourceFile, module: types.ModuleType | None, construction: Construction) -> bool:
    """Whether the call that constructed a module names its class by a module-level name of the
    file (`RMSNorm(...)`), a name the output's copy of the code binds to the rewritten class. A
    class reached any other way is the installed one wherever the call is written: a config's
    attribute (`config.norm_class(...)`, resolved from a name at run time), a parameter, a
    module's attribute (`litgpt.model.RMSNorm`), a `functools.partial` of it."""
    call = source.node_at(construction.line, construction.col, construction.end_line, construction.end_col)
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        return False
    scope = source.wrapper.resolve(ScopeProvider).get(call.func)
    if scope is None or not all(isinstance(a.scope, GlobalScope) for a in scope[call.func.value]):
        return False        # a local or a parameter: whatever the caller handed over
    return module is not None and getattr(module, call.func.value, None) is construction.cls


def _constructed_elsewhere(entry: Entry | None, library: dict[int, tuple[object, str]], rewritten_code,
                           resolved_calls: dict[tuple[int, int], object]) -> list[tuple[type, str]]:
    """(library class, rewritten name) of each module of the model that build() constructs not by
    a call of the entry file's that now names the rewritten class, nor by the rewritten code
    (`rewritten_code(construction)`): through a factory."""
    if entry is None:
        return []
    entry_file = str(Path(entry.path).resolve())
    found = {}
    for construction in entry.constructions.values():
        hit = library.get(id(construction.cls))
        if hit is None or hit[0] is not construction.cls or rewritten_code(construction):
            continue        # not a library class the file rewrites, or constructed by the rewritten code
        if construction.file == entry_file and resolved_calls.get(
                (construction.end_line, construction.end_col)) is construction.cls:
            continue        # `Class(...)` in the entry file, now naming the rewritten class
        found[hit[1]] = (construction.cls, hit[1])
    return [found[name] for name in sorted(found)]


# Appended to a rank file whose build() constructs a library class by a route the rewrite cannot
# name (a factory): the library class's __init__, while build() runs, turns a new object of that
# very class into one of the rewritten class. Its own __init__ is put back afterwards.
FACTORY_BUILD = '''import functools

{imports}

def _constructing_rewritten(build, rewritten_of):
    """`build` as the entry file wrote it, except that constructing a library class in
    `rewritten_of`, by whatever route build() takes to it (a factory such as from_config, a
    registry), constructs the rewritten class it maps to."""

    @functools.wraps(build)
    def build_rewritten(*args, **kwargs):
        own_init = {{library: vars(library).get("__init__") for library in rewritten_of}}
        for library, rewritten in rewritten_of.items():
            library.__init__ = _init_as(library, rewritten)
        try:
            return build(*args, **kwargs)
        finally:
            for library, init in own_init.items():
                if init is None:
                    del library.__init__
                else:
                    library.__init__ = init
    return build_rewritten


def _init_as(library, rewritten):
    """An __init__ for `library` that makes a new object of exactly that class a `rewritten`
    one: the object takes the rewritten class and runs its __init__."""
    library_init = library.__init__

    def __init__(self, *args, **kwargs):
        if type(self) is library:
            self.__class__ = rewritten
            rewritten.__init__(self, *args, **kwargs)
        else:
            library_init(self, *args, **kwargs)
    return __init__


build = _constructing_rewritten(build, {{{mapping}}})
'''


def _factory_section(classes: list[tuple[type, str]], entry: Entry, entry_path: Path) -> list[cst.CSTNode]:
    """Wrap build() so that constructing each library class constructs its rewritten class."""
    sites = sorted({(c.entry_line, c.entry_col) for c in entry.constructions.values()
                    if c.entry_line and any(c.cls is cls for cls, _ in classes)})
    where = ", ".join(f"{display_path(entry_path)}:{line}:{col + 1}" for line, col in sites)
    library_names = {name: f"_library_{name}" for _, name in classes}
    imports = "".join(f"from {cls.__module__} import {name} as {library_names[name]}\n" for cls, name in classes)
    mapping = ", ".join(f"{library_names[name]}: {name}" for _, name in classes)
    listed = ", ".join(f"{cls.__module__}.{name}" for cls, name in classes)
    code = FACTORY_BUILD.format(imports=imports, mapping=mapping)
    body = list(cst.parse_module(code).body)
    text = (f"--- build() constructs {listed} by a call that does not name the class"
            + (f" ({where}: a factory, a registry, a class held in a value)" if where
               else " (a factory, a registry, a class held in a value)")
            + ": while it runs, constructing that class constructs the rewritten class of the same name "
            "above instead ---")
    header = [cst.EmptyLine(comment=cst.Comment(f"# {line}"))
              for line in textwrap.wrap(text, 96, break_long_words=False, break_on_hyphens=False)]
    body[0] = body[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *header])
    return body


def split_after_build_section(shares: dict[str, tuple[int, int, list[str]]], built_at: list[str], axis: str) -> str:
    """The text appended to a rank file whose layers are built whole and cut after build(): the
    table of what each rank keeps, and build() wrapped to cut them (_comm.split_after_build)."""
    if not shares:
        return ""
    where = ", ".join(built_at) if built_at else "library code"
    text = (f"--- built whole, then cut: no one edit of the constructor call ({where}) builds every "
            "layer made there at its own split (one call builds layers split unalike, or sizes them "
            f"from a config object), so build() builds them whole and each {axis} rank keeps its share ---")
    lines = ["", ""] + [f"# {line}" for line in textwrap.wrap(text, 96, break_long_words=False,
                                                                 break_on_hyphens=False)]
    lines.append("SPLIT_AFTER_BUILD = {  # parameter: (dim, fused blocks, the layer's attributes holding that size)")
    lines += [f"    {name!r}: {share!r}," for name, share in shares.items()]
    lines += ["}", f"build = split_after_build(build, SPLIT_AFTER_BUILD, {axis})", ""]
    return "\n".join(lines)


def instance_classes_section(classes: dict[str, str], imports: dict[str, list[str]]) -> str:
    """The text appended to a rank file whose block instances run variant classes (emit/variants.py):
    the imports of those a mirror defines (`imports`: mirror module -> names), the table of each
    instance's class, and build() wrapped to set them (_comm.instance_classes)."""
    if not classes:
        return ""
    text = ("--- one block class, instances split unalike: each of these runs its own variant of its "
            "class (the class's forward rewritten for its splits), set as its class after build() ---")
    lines = ["", ""] + [f"# {line}" for line in textwrap.wrap(text, 96, break_long_words=False,
                                                                 break_on_hyphens=False)]
    lines += [f"from {module} import {', '.join(sorted(names))}" for module, names in sorted(imports.items())]
    lines.append("INSTANCE_CLASSES = {  # module: its class")
    lines += [f"    {path!r}: {name}," for path, name in classes.items()]
    lines += ["}", "build = instance_classes(build, INSTANCE_CLASSES)", ""]
    return "\n".join(lines)


def merge_entry(model: cst.Module, model_path: Path, entry: cst.Module, entry_path: Path,
                loaded: Entry | None = None, rewritten_code=None) -> cst.Module:
    """The model file followed by the entry file's own code (build(), example_inputs(), ...),
    whose uses of the library's classes name the rewritten ones.

    `loaded` is the entry as it ran (its module, what build() constructed); without it the
    entry's code is taken as it is written. `rewritten_code(construction)`: whether a module of
    the model was constructed by code the merged file defines anew (by default, any code of the
    model file).
    """
    package = (module_name_of(model_path) or "").rpartition(".")[0]
    if package:
        model = model.visit(AbsoluteImports(package))
    defined = _defined_names(model)
    namespace = vars(loaded.module) if loaded is not None else {}
    library = _library_objects(model_path, defined) if loaded is not None else {}
    factory: list[tuple[type, str]] = []
    if library:
        _check_bindings(entry, defined, namespace, library, model_path, entry_path)
        naming = NameRewritten(namespace, library, entry_path)
        entry = MetadataWrapper(entry).visit(naming)
        entry = entry.visit(DropImportedNames(defined, naming.unused))
        model_file = str(Path(model_path).resolve())
        factory = _constructed_elsewhere(loaded, library, rewritten_code or (lambda c: c.file == model_file),
                                         naming.resolved_calls)
    else:
        entry = entry.visit(DropImportedNames(defined))
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
    if factory and callable(getattr(loaded.module, "build", None)):    # (not with --model and no build())
        body += _factory_section(factory, loaded, entry_path)
    return model.with_changes(body=[*model.body, *body])


def merge_entry_mirrored(entry: cst.Module, entry_path: Path, loaded: Entry,
                         defined: dict[str, tuple[object, str]], rewritten_code) -> cst.Module:
    """The entry file's code (build(), example_inputs(), ...) as the program file of a model
    written out as mirrors: its uses of the library's classes name the rewritten ones, imported
    from their mirrors. `defined`: rewritten name -> (the library's object, the mirror module
    that defines it anew, relative to the output package); `rewritten_code(construction)`:
    whether a module of the model was constructed by code the mirrors hold."""
    namespace = vars(loaded.module)
    library = {id(obj): (obj, name) for name, (obj, _, _) in defined.items()}
    original = entry
    naming = NameRewritten(namespace, library, entry_path)
    entry = MetadataWrapper(entry).visit(naming)
    entry = entry.visit(DropImportedNames(set(defined), naming.unused))
    factory = _constructed_elsewhere(loaded, library, rewritten_code, naming.resolved_calls)
    imported = naming.named | {name for _, name in factory}
    for name in sorted(imported):
        _check_bindings(original, {name}, namespace, library, Path(defined[name][2]), entry_path)
    imports: dict[str, list[str]] = {}
    for name in sorted(imported):
        imports.setdefault(defined[name][1], []).append(name)
    lines = [cst.parse_statement(f"from {module} import {', '.join(names)}  # rewritten\n")
             for module, names in sorted(imports.items())]
    entry = after_imports(entry, lines)
    body = list(entry.body)
    if factory and callable(getattr(loaded.module, "build", None)):
        body += _factory_section(factory, loaded, entry_path)
    return entry.with_changes(body=body)


def add_comm_import(module: cst.Module, names: set[str], needs_torch: bool) -> cst.Module:
    """`from ._comm import TP, tp_copy` (and `import torch`) after the file's first imports."""
    lines = []
    if needs_torch and "import torch\n" not in module.code:
        lines.append(cst.parse_statement("import torch\n"))
    if names:
        lines.append(cst.parse_statement(f"from ._comm import {', '.join(sorted(names))}\n"))
    return after_imports(module, lines)


def after_imports(module: cst.Module, lines: list[cst.BaseStatement]) -> cst.Module:
    """The module with `lines` placed after its first block of imports (after the docstring
    when it has none)."""
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


def model_files(own_files: list[str], entry_path: Path) -> list[Path]:
    """The files of the model's classes other than the entry file, in a fixed order."""
    return [Path(p) for p in sorted({str(Path(p).resolve()) for p in own_files} - {str(entry_path.resolve())})]
