"""Let FakeTensorMode run without importing all of torch._dynamo.

FakeTensorMode reads a few flags from `torch._dynamo.config`, and `import torch._dynamo.config`
runs the package's __init__, which imports the compiler (sympy, the bytecode tracer, export):
about 2 s of a 4 s `plan` on a model that does not import transformers (which imports dynamo
itself). `defer()` loads the real config module on its own and stands a placeholder package
in for torch._dynamo. The first use of anything else (an attribute of the placeholder, or an
import of another submodule) imports the real package, which adopts the config module already
loaded, so the process ends with one torch._dynamo, exactly as without the placeholder.
"""
from __future__ import annotations

import copy
import functools
import importlib
import importlib.abc
import importlib.util
import sys
import threading
import types

PACKAGE = "torch._dynamo"
_lock = threading.RLock()


class _Placeholder(types.ModuleType):
    """torch._dynamo until something needs more than its config."""

    def __getattr__(self, name):
        if name.startswith("__") and name != "__all__":     # probes such as inspect.getmodule's
            raise AttributeError(name)
        return getattr(_realize(), name)

    @staticmethod
    def disable(fn=None, recursive=True, **options):
        """torch._disable_dynamo (around FakeTensorMode's dispatch, torch.empty, ...) asks for
        this. While the placeholder stands nothing can be compiling, so the call runs as it is;
        once the real package is in, each call goes through its disable."""
        if fn is None:
            return lambda f: _Placeholder.disable(f, recursive, **options)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            module = sys.modules.get(PACKAGE)
            if module is None or isinstance(module, _Placeholder):
                return fn(*args, **kwargs)
            return module.disable(fn, recursive, **options)(*args, **kwargs)
        return call


class _ImportsRealPackage(importlib.abc.MetaPathFinder):
    """An import of any other torch._dynamo submodule first imports the real package (which
    imports most of its submodules), then hands back the module that import made."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + ".") or not isinstance(sys.modules.get(PACKAGE), _Placeholder):
            return None
        _realize()
        module = sys.modules.get(fullname)
        if module is None:          # a submodule the package does not import itself: the usual way
            return None
        spec = copy.copy(module.__spec__)
        spec.loader = _AlreadyLoaded()
        return spec


class _AlreadyLoaded(importlib.abc.Loader):
    def create_module(self, spec):
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass


_FINDER = _ImportsRealPackage()


def defer() -> None:
    """Stand the placeholder in, unless torch._dynamo is imported already (transformers does)."""
    import torch
    with _lock:
        if PACKAGE in sys.modules:
            return
        real_spec = importlib.util.find_spec(PACKAGE)
        config_name = PACKAGE + ".config"
        config_spec = importlib.util.spec_from_file_location(
            config_name, real_spec.submodule_search_locations[0] + "/config.py")
        config = importlib.util.module_from_spec(config_spec)
        sys.modules[config_name] = config
        try:
            config_spec.loader.exec_module(config)
        except BaseException:
            del sys.modules[config_name]
            raise
        placeholder = _Placeholder(PACKAGE)
        placeholder.__path__ = list(real_spec.submodule_search_locations)
        placeholder.__spec__, placeholder.__file__, placeholder.__loader__ = \
            real_spec, real_spec.origin, real_spec.loader
        placeholder.config = config
        sys.modules[PACKAGE] = placeholder
        torch._dynamo = placeholder
        sys.meta_path.insert(0, _FINDER)


def _realize() -> types.ModuleType:
    import torch
    with _lock:
        module = sys.modules.get(PACKAGE)
        if isinstance(module, _Placeholder):
            del sys.modules[PACKAGE]
            del torch._dynamo
            if _FINDER in sys.meta_path:
                sys.meta_path.remove(_FINDER)
            module = importlib.import_module(PACKAGE)   # its `from . import config` reuses ours
        return module
