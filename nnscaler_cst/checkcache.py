"""`--check` without tracing: what an output folder was generated from, and a fast answer.

A rewrite records in the output's `.nnscaler/check.json` a fingerprint of everything its
files depend on: the options (command line over pyproject), the entry file's path as the
output names it, every file the rewrite read outside the Python installation (the model and
entry files, local modules, the rules tables), which `*.toml` each read rules folder holds,
the versions of the distributions it read code from (torch, transformers, ...), the tool's
own files, Python's version and `NNSCALER_*` variables; and the hash of each generated file.
When all of that is unchanged, the new generation is the pristine copy, so the output is
current exactly when the pristine copy is intact and no file holds unresolved conflict
markers (hand edits that merged cleanly are not staleness). Anything else, or anything
unexpected, means "don't know": the caller runs the full check.

The fast answer must stay cheap: standard library only, never torch, LibCST, typer or rich.
The fingerprint holds no absolute path of the Python installation and no times, so a cache
committed from one machine answers on another with the same inputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from .emit.merge import has_unresolved_conflict
from .emit.pristine import CHECK_CACHE, PRISTINE_DIR
from .errors import display_path

CACHE_FORMAT = 1
PACKAGE_DIR = Path(__file__).resolve().parent
# Options that say where the output goes, not what it holds.
NOT_INPUTS = {"out", "model_file"}
# These shape every output even when the rewrite read none of their files (already imported).
ALWAYS_DISTS = ("torch", "libcst", "z3-solver")

_recorders: list[set[str]] = []


@contextmanager
def recording():
    """Collect the paths of files opened for reading while the block runs (sys audit hook)."""
    if not getattr(sys, "_nnscaler_read_hook", False):
        sys.addaudithook(_on_audit)          # a hook cannot be removed: install once, gate on _recorders
        sys._nnscaler_read_hook = True
    opened: set[str] = set()
    _recorders.append(opened)
    try:
        yield opened
    finally:
        _recorders.remove(opened)


def _on_audit(event: str, args: tuple) -> None:
    if event != "open" or not _recorders:
        return
    path, mode, flags = args
    if not isinstance(path, str):
        return
    if isinstance(mode, str):                 # open() and io.open_code()
        reading = not any(c in mode for c in "wax+")
    else:                                     # os.open()
        reading = not (flags or 0) & (os.O_WRONLY | os.O_RDWR)
    if reading:
        for opened in _recorders:
            opened.add(path)


def effective_options(given: dict, project: dict) -> dict[str, str]:
    """The options that differ from the tool's own defaults: the command line's over the
    `[tool.nnscaler-rewrite]` table's (config.project_defaults), as text. Both the rewrite and
    the fast check compute them so, whichever of the two places a value came from."""
    merged = {**project, **{k: v for k, v in given.items() if v is not None}}
    return {k: str(v) for k, v in sorted(merged.items()) if k not in NOT_INPUTS}


def record(model_file: Path, options: dict[str, str], opened: set[str], generated: dict[str, str],
           out_dir: Path) -> str:
    """The text of check.json for a generation made with `options` that read `opened`."""
    out_dir = Path(out_dir).resolve()
    files, toml_dirs = {display_path(model_file): _hash_file(Path(model_file))}, set()
    local, site_tops = local_sources(opened)
    for path in local:
        if _is_below(path, out_dir):
            continue                         # our output
        files[display_path(path)] = _hash_file(path)
        if path.suffix == ".toml" and path.name != "pyproject.toml":
            toml_dirs.add(path.parent)
    inputs = {
        **_fixed_inputs(model_file, options),
        "files": files,
        "toml_listings": {display_path(d): _toml_names(d) for d in sorted(toml_dirs)},
        "dists": _dist_versions_at_record(site_tops),
    }
    cache = {"format": CACHE_FORMAT, "inputs": inputs,
             "outputs": {name: _hash_text(text) for name, text in sorted(generated.items())}}
    return json.dumps(cache, indent=1, sort_keys=True) + "\n"


def local_sources(opened: set[str]) -> tuple[list[Path], set[str]]:
    """(the files read outside the Python installation, the tool and the OS: the model and
    entry files, local modules, rules tables; the top-level names of the installed packages
    read), from the paths `recording()` collected."""
    sites = _site_dirs()
    library = sorted({*sites, *_stdlib_dirs()}, key=lambda p: -len(p.parts))     # innermost first
    builtin_rules = _builtin_rules_dir().resolve()
    local, site_tops = [], set()
    for raw in sorted(opened):
        path = Path(raw)
        if not path.is_absolute():
            path = Path.cwd() / path
        if path.suffix == ".pyc":            # an import read the cached bytecode, not the source
            path = _source_of(path)
        if path is None or not path.is_file():
            continue
        path = path.resolve()
        root = next((r for r in library if _is_below(path, r)), None)
        if root is not None:
            if root in sites:
                site_tops.add(path.relative_to(root).parts[0].split(".")[0])
            continue
        if any(_is_below(path, d) for d in (PACKAGE_DIR, builtin_rules)) \
                or str(path).startswith(("/proc/", "/sys/", "/dev/")):
            continue                         # the tool's own (fingerprinted), the OS
        local.append(path)
    return local, site_tops


def recorded_options(out_dir: Path) -> dict[str, str] | None:
    """The options the output was last written with (as effective_options gives them), or None
    when it holds no readable record (not written by the tool, or before records were kept)."""
    try:
        options = json.loads((Path(out_dir) / CHECK_CACHE).read_text(encoding="utf-8"))["inputs"]["options"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return options if isinstance(options, dict) else None


def is_current(model_file: Path, options: dict[str, str], out_dir: Path) -> bool:
    """True only when the cache proves the output current; False means "run the full check"."""
    out_dir = Path(out_dir)
    try:
        cache = json.loads((out_dir / CHECK_CACHE).read_text(encoding="utf-8"))
        if cache.get("format") != CACHE_FORMAT:
            return False
        recorded = cache["inputs"]
        if {k: recorded.get(k) for k in ("tool", "python", "entry", "options", "env")} != \
                _fixed_inputs(model_file, options):
            return False
        if any(not Path(p).is_file() or _hash_file(Path(p)) != h for p, h in recorded["files"].items()):
            return False
        if any(_toml_names(Path(d)) != names for d, names in recorded["toml_listings"].items()):
            return False
        installed = _installed_versions()
        if any(installed.get(name) != version for name, version in recorded["dists"].items()):
            return False
        return _output_intact(out_dir, cache["outputs"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _output_intact(out_dir: Path, outputs: dict[str, str]) -> bool:
    """The pristine copy is the recorded generation; every generated file is there and no
    hand-edited one holds unresolved conflict markers."""
    pristine_dir = out_dir / PRISTINE_DIR
    if sorted(p.relative_to(pristine_dir).as_posix() for p in pristine_dir.rglob("*") if p.is_file()) \
            != sorted(outputs):
        return False
    for name, digest in outputs.items():
        base = (pristine_dir / name).read_text(encoding="utf-8")
        if _hash_text(base) != digest:
            return False
        path = out_dir / name
        if not path.is_file():
            return False
        text = path.read_text(encoding="utf-8", errors="replace")
        if text != base and has_unresolved_conflict(text, base):
            return False
    return True


def _fixed_inputs(model_file: Path, options: dict[str, str]) -> dict:
    """The inputs known before tracing: options, entry path, tool, Python, environment."""
    return {
        "tool": _tool_fingerprint(),
        "python": "%d.%d" % sys.version_info[:2],
        "entry": display_path(model_file),
        "options": options,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NNSCALER_")},
    }


def _tool_fingerprint() -> str:
    """The tool's version and the hash of its own files: code, runtime and built-in rules, by
    their path inside the tool, so a checkout and an installed wheel of one commit agree."""
    from . import __version__
    rules = _builtin_rules_dir()
    files = {}
    for root, prefix in ((PACKAGE_DIR, ""), *([(rules, "rules/")] if not _is_below(rules, PACKAGE_DIR) else [])):
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in names:
                if name.endswith((".py", ".toml")):
                    path = Path(folder, name)
                    files[prefix + path.relative_to(root).as_posix()] = path
    digest = hashlib.sha256()
    for key in sorted(files):               # by key: the same order wherever the rules live
        digest.update(key.encode() + b"\0" + files[key].read_bytes())
    return f"{__version__} sha256:{digest.hexdigest()[:16]}"


def _builtin_rules_dir() -> Path:
    """As rules_path.builtin_rules_dir: inside the package when installed, else the checkout's
    rules/ (repeated here so that this module reads no rules code)."""
    installed = PACKAGE_DIR / "rules"
    return installed if (installed / "plans").is_dir() else PACKAGE_DIR.parent / "rules"


def _source_of(bytecode: Path) -> Path | None:
    from importlib.util import source_from_cache
    try:
        return Path(source_from_cache(str(bytecode)))
    except ValueError:                       # not in a __pycache__ folder: no source to watch
        return None


def _stdlib_dirs() -> set[Path]:
    import sysconfig
    paths = sysconfig.get_paths()
    return {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib")}


def _site_dirs() -> set[Path]:
    """Where installed packages live (their versions stand for their files)."""
    import site
    import sysconfig
    paths = sysconfig.get_paths()
    return {Path(d).resolve() for d in (*site.getsitepackages(), site.getusersitepackages(),
                                        paths["purelib"], paths["platlib"])}


def _dist_versions_at_record(site_tops: set[str]) -> dict[str, str]:
    """{distribution: version} of the installed packages the rewrite read code from."""
    from importlib import metadata
    owners = metadata.packages_distributions()
    names = {*ALWAYS_DISTS, *(d for top in site_tops for d in owners.get(top, ()))}
    versions = {}
    for name in names:
        try:
            versions[_normal(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return dict(sorted(versions.items()))


def _installed_versions() -> dict[str, str]:
    """{distribution: version} from the `NAME-VERSION.dist-info` folders on sys.path: a
    directory listing each, cheaper than importlib.metadata."""
    versions: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and "-" in name:
                dist, _, version = name[:-len(".dist-info")].partition("-")
                versions.setdefault(_normal(dist), version)
    return versions


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _toml_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.toml"))


def _is_below(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _hash_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _hash_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

