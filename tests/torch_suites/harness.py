"""Run PyTorch's own distributed tests against spmd.runtime, with only their imports changed.

The test files ship inside the torch wheel (``torch/testing/_internal/...``); nothing of
them is copied here. An import hook loads each one from the installed torch, rewrites its
import statements (``torch.distributed`` -> ``spmd.runtime`` and so on, and the test
modules' imports of each other to the rewritten copies), and executes the result under
the package name ``torch_as_spmd``. Only ``import``/``from ... import`` lines change;
code that names ``torch.distributed`` in a test body still reaches torch's module, which
is how a test that reads torch internals shows up (and is listed as an exception).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import marshal
import os
import sys
import types

PACKAGE = "torch_as_spmd"

# torch module -> ours. Longest prefix wins; a submodule not listed keeps its tail
# (torch.distributed.rpc.api -> spmd.runtime.rpc.api).
MODULES = {
    "torch.distributed.distributed_c10d": "spmd.runtime",
    "torch.distributed.rpc": "spmd.runtime.rpc",
    "torch.distributed.autograd": "spmd.runtime.autograd",
    "torch.distributed.optim": "spmd.runtime.optim",
    "torch.distributed.nn.api.remote_module": "spmd.runtime.rpc.remote_module",
    "torch.distributed.nn": "spmd.runtime.rpc",
    "torch.distributed": "spmd.runtime",
    # torch's own helpers built on the public API, which see our groups through it
    "torch.distributed.algorithms": "torch.distributed.algorithms",
    "torch.distributed.utils": "torch.distributed.utils",
    "torch.distributed.optim.post_localSGD_optimizer": "torch.distributed.optim.post_localSGD_optimizer",
}

# torch's test modules that are loaded rewritten (their imports of each other included)
TEST_MODULES = (
    "torch.testing._internal.dist_utils",
    "torch.testing._internal.distributed.rpc",
    "torch.testing._internal.distributed.ddp_under_dist_autograd_test",
    "torch.testing._internal.distributed.nn",
    "torch.testing._internal.distributed.distributed_test",
    "torch.testing._internal.distributed.rpc_utils",
)

# ... except these, which stay torch's own: TorchScript compiles remote calls into torch's
# C++ RPC operators, which no other runtime can serve (an exclusion the issue names)
TORCH_ONLY = ("torch.testing._internal.distributed.rpc.jit",)

_PREFIX = "torch.testing._internal"


def _within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


# torch test modules a file loaded by load_file(also=...) needs rewritten too (this
# process only: spawned ranks do not import those files)
_also: set[str] = set()


def _is_test_module(name: str) -> bool:
    return _within(name, TEST_MODULES + tuple(_also)) and not _within(name, TORCH_ONLY)


_LONGEST_FIRST = sorted(MODULES, key=len, reverse=True)


def ours(name: str) -> str:
    """The module an import of ``name`` is pointed at."""
    if _is_test_module(name):
        return PACKAGE + name[len(_PREFIX):]
    for theirs in _LONGEST_FIRST:
        if name == theirs or name.startswith(theirs + "."):
            return MODULES[theirs] + name[len(theirs):]
    return name


class TorchInternal:
    """Stands for a private torch name that spmd.runtime does not have.

    A module-level ``from torch.distributed.rpc import _private`` would otherwise fail the
    whole test file; instead the tests that actually call the name fail, naming it. Its
    attributes are further placeholders, one per name, so a test that only passes one
    around as a token (``mode=RPCExecMode.SYNC`` ... ``if mode == RPCExecMode.SYNC``)
    still compares them by identity."""

    def __init__(self, module: str, name: str) -> None:
        self._where = f"{module}.{name}" if name else module
        self._attrs: dict[str, TorchInternal] = {}

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"torch internal {self._where} has no spmd.runtime equivalent")

    def __getattr__(self, attr: str):
        if attr.startswith("__") or attr in ("_where", "_attrs"):
            raise AttributeError(attr)
        if attr not in self._attrs:
            self._attrs[attr] = TorchInternal(self._where, attr)
        return self._attrs[attr]

    def __repr__(self) -> str:
        return f"<torch internal {self._where}>"

    def __bool__(self) -> bool:  # `if _TORCHCOMM_AVAILABLE:`: a torch feature we lack
        return False


def import_names(module: str, names: tuple[str, ...]) -> tuple:
    """``from module import names``, where a missing private name is a TorchInternal.

    A module spmd.runtime does not have at all (``torch.distributed.rpc.internal``) is one
    of torch's internals: every name imported from it is a TorchInternal."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError:
        if not module.startswith("spmd."):
            raise
        return tuple(TorchInternal(module, name) for name in names)
    out = []
    for name in names:
        if hasattr(mod, name):
            out.append(getattr(mod, name))
            continue
        try:
            out.append(importlib.import_module(f"{module}.{name}"))
        except ModuleNotFoundError:
            if not name.startswith("_") or not module.startswith("spmd."):
                raise ImportError(f"cannot import name {name!r} from {module!r}") from None
            out.append(TorchInternal(module, name))
    return tuple(out)


def import_module(module: str):
    """``import module as x``; a module spmd.runtime lacks is a TorchInternal."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        if not module.startswith("spmd."):
            raise
        return TorchInternal(module, "")


class _Rewriter(ast.NodeTransformer):
    def visit_Import(self, node: ast.Import):
        # `import torch.distributed` binds `torch` and is left alone; `import X as y` becomes
        # `y = __spmd_import_module__("ours")`
        if any(a.asname is None or ours(a.name) == a.name for a in node.names):
            return node
        new = [ast.copy_location(ast.Assign(
            [ast.Name(a.asname, ast.Store())],
            ast.Call(ast.Name("__spmd_import_module__", ast.Load()), [ast.Constant(ours(a.name))], [])),
            node) for a in node.names]
        return [ast.fix_missing_locations(n) for n in new]

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.level or node.module is None or ours(node.module) == node.module:
            return node
        module = ours(node.module)
        if module.startswith(PACKAGE) or any(a.name == "*" for a in node.names):
            node.module = module
            return node
        targets = [ast.Name(a.asname or a.name, ast.Store()) for a in node.names]
        call = ast.Call(
            ast.Name("__spmd_import_names__", ast.Load()),
            [ast.Constant(module), ast.Tuple([ast.Constant(a.name) for a in node.names], ast.Load())],
            [])
        new = ast.Assign([ast.Tuple(targets, ast.Store())], call)
        return ast.fix_missing_locations(ast.copy_location(new, node))


def rewrite(source: str, filename: str = "<torch test>"):
    """Point the import statements of a torch test module at spmd.runtime; returns code."""
    tree = _Rewriter().visit(ast.parse(source, filename))
    return compile(ast.fix_missing_locations(tree), filename, "exec")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        if fullname == PACKAGE:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        theirs = importlib.util.find_spec(_PREFIX + fullname[len(PACKAGE):])
        if theirs is None:
            return None
        spec = importlib.machinery.ModuleSpec(
            fullname, self, origin=theirs.origin,
            is_package=theirs.submodule_search_locations is not None)
        spec.has_location = True
        spec.loader_state = theirs
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        spec = module.__spec__
        if spec.name == PACKAGE:
            module.__path__ = []
            return
        theirs = spec.loader_state
        module.__file__ = theirs.origin
        if theirs.submodule_search_locations is not None:
            module.__path__ = []
        module.__spmd_import_names__ = import_names
        module.__spmd_import_module__ = import_module
        exec(_code(theirs.origin), module.__dict__)


@functools.cache
def _harness_digest() -> bytes:
    """This file's hash, once per process: a changed rewrite invalidates the cache."""
    with open(__file__, "rb") as f:
        return hashlib.sha1(f.read()).digest()


def _code(path: str):
    """The rewritten module's code, cached on disk: every test spawns fresh processes, and
    each would otherwise parse and compile thousands of lines again."""
    stat = os.stat(path)
    key = hashlib.sha1(_harness_digest() + f"{path}{stat.st_mtime_ns}{stat.st_size}"
                       f"{sys.version}".encode()).hexdigest()
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "spmd-torch-suites", key)
    try:
        with open(cache, "rb") as f:
            return marshal.load(f)
    except (OSError, EOFError, ValueError, TypeError):
        pass
    with open(path, encoding="utf-8") as f:
        code = rewrite(f.read(), path)
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}"
        with open(tmp, "wb") as f:
            marshal.dump(code, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only home: compile every time
    return code


def load_file(path: str, name: str, also: tuple[str, ...] = ()) -> types.ModuleType:
    """Load a test file of a PyTorch source checkout (``test/distributed/test_store.py``:
    not in the wheel) rewritten, as module ``torch_as_spmd.<name>``. ``also``: torch test
    modules it imports that must be rewritten as well (``common_distributed``, whose
    ``create_tcp_store`` the store tests call)."""
    install()
    _also.update(also)
    fullname = f"{PACKAGE}.{name}"
    spec = importlib.util.spec_from_loader(fullname, loader=None, origin=path)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = path
    module.__spmd_import_names__ = import_names
    module.__spmd_import_module__ = import_module
    sys.modules[fullname] = module
    exec(_code(path), module.__dict__)
    return module


def install() -> None:
    """Make ``torch_as_spmd.<module>`` importable (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
