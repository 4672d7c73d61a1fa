"""The package's shape: one import root from four folders, a light runtime, honest __all__."""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"spmd": "spmd", "lowering": "spmd.lowering", "kernels": "spmd.kernels",
          "runtime": "spmd.runtime"}


def _packages_on_disk() -> set[str]:
    found = set()
    for folder, name in LAYERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == _packages_on_disk()
    assert config["package-dir"] == {v: k for k, v in LAYERS.items()}


@pytest.mark.parametrize("package", sorted(_packages_on_disk()))
def test_every_name_in_all_resolves(package):
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", []):
        assert getattr(module, name) is not None, f"{package}.{name}"


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the four folders, by the name it is imported as."""
    return {_module_name(path): path
            for folder in LAYERS for path in (ROOT / folder).rglob("*.py")}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path] | None = None) -> list[str]:
    """The modules ``path`` imports, anywhere in it (function-local imports too)."""
    return _imports_in(path.read_text(), _module_name(path), path.name == "__init__.py",
                       _modules() if modules is None else modules)


def _imports_in(source: str, name: str, is_package: bool,
                modules: dict[str, pathlib.Path] | set[str]) -> list[str]:
    """The modules module ``name`` (its ``source``) imports: ``from P import m`` where
    ``P.m`` is a module on disk (in ``modules``) imports ``P.m``, not only the package
    ``P``; relative imports are resolved against ``name``'s package."""
    package = name if is_package else name.rpartition(".")[0]
    names = []
    tree = ast.parse(source)
    typing_only = {id(inner) for node in ast.walk(tree) if _is_type_checking(node)
                   for stmt in node.body for inner in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # read by annotations only: nothing runs it
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                names.append(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                             else base)
    return list(dict.fromkeys(names))


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): a block only type checkers
    read."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def test_imports_see_submodules_relative_and_function_local_imports():
    modules = {"spmd.lowering", "spmd.lowering.ranked", "spmd.lowering.placements",
               "spmd.lowering.rules", "spmd.lowering.rules.matmul"}
    source = ("from spmd.lowering import ranked, rules\n"
              "from spmd.lowering.placements import Shard\n"
              "def f():\n"
              "    from . import matmul\n"
              "    from .. import ranked as r\n"
              "    from ..rules import matmul as m, register\n"
              "    import spmd.runtime\n")
    found = _imports_in(source, "spmd.lowering.rules.probe", False, modules)
    assert found == ["spmd.lowering.ranked", "spmd.lowering.rules", "spmd.lowering.placements",
                     "spmd.lowering.rules.matmul", "spmd.runtime"]
    # names only annotations read (under TYPE_CHECKING) are no import: nothing runs them
    typed = ("from typing import TYPE_CHECKING\n"
             "if TYPE_CHECKING:\n"
             "    from spmd.lowering.ranked import Ring\n"
             "else:\n"
             "    from spmd.lowering import placements\n")
    assert _imports_in(typed, "spmd.lowering.probe", False, modules) == [
        "typing", "spmd.lowering.placements"]


def test_dependencies_point_one_way():
    allowed = {  # folder -> the spmd packages it may import
        "runtime": ("spmd.runtime",),
        "kernels": ("spmd.kernels", "spmd.runtime"),
        "lowering": ("spmd.lowering", "spmd.kernels", "spmd.runtime"),
    }
    modules = _modules()
    for folder, ok in allowed.items():
        paths = list((ROOT / folder).rglob("*.py"))
        assert len(paths) > 5, f"{folder}: {paths}"  # the layer's files were found
        for path in paths:
            for name in _imports(path, modules):
                if name == "spmd" or name.startswith("spmd."):
                    assert name.startswith(ok), f"{path.relative_to(ROOT)} imports {name}"
                assert name.split(".")[0] not in ("runtime", "lowering", "kernels"), (
                    f"{path.relative_to(ROOT)}: bare import {name}; use spmd.{name}")


def _module_name(path: pathlib.Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rel = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = [LAYERS[folder], *rel]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("folder", ["spmd", "lowering", "kernels"])
def test_no_import_cycles_within_a_layer(folder):
    """Imports anywhere in a module (function-local ones too) form no cycle: each module
    of the compiler can be read, and changed, before the ones that import it."""
    import networkx as nx

    everywhere = _modules()
    modules = {name: path for name, path in everywhere.items()
               if path.is_relative_to(ROOT / folder)}
    assert len(modules) >= 10, f"{folder}: {sorted(modules)}"  # the layer's modules were found
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for imported in _imports(path, everywhere):
            # a name imported from a module (``from m import f``) is an import of ``m``;
            # the root package ``spmd`` resolves its names lazily, importing nothing
            if imported in modules and imported not in (name, "spmd"):
                graph.add_edge(name, imported)
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert cycles == [], f"{len(cycles)} import cycles, the shortest: {cycles[:5]}"


def test_runtime_import_is_light():
    code = ("import sys, spmd.runtime; "
            "print(sorted(m for m in ('torch', 'spmd.lowering', 'spmd.kernels', 'zmq') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.strip() == "[]"


def test_library_code_does_not_print():
    for folder in LAYERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    pytest.fail(f"print() in library code: {path.relative_to(ROOT)}:{node.lineno}")


def test_built_wheel_installs_and_imports(tmp_path):
    """The wheel (not only the editable install) carries all four folders under spmd/."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True, timeout=110,
    )
    (wheel,) = (tmp_path / "dist").glob("spmd-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in ("spmd/__init__.py", "spmd/runtime/store/tcp_store.py",
                     "spmd/lowering/__init__.py", "spmd/kernels/__init__.py"):
        assert expected in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=110)
    code = ("import spmd.runtime as r; s = r.HashStore(); s.set('k', 'v'); "
            "print(r.__file__, s.get('k'))")
    # -S: no site-packages, so neither the editable install nor anything else can answer
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(target)}, cwd=tmp_path, check=True)
    assert out.stdout.startswith(str(target)) and out.stdout.strip().endswith("b'v'")


def test_the_kernels_folder_does_not_shadow_pypis_kernels_package():
    """Run from the repository root, ``import kernels`` finds this folder first (transformers
    >= 5.25 imports Hugging Face's ``kernels`` package and failed on ours): the folder loads
    the installed package in its place, and ``spmd.kernels`` stays ours."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no package named 'kernels' is installed here")
    code = ("import kernels, spmd.kernels, os; "
            "print(os.path.dirname(kernels.__file__), os.path.dirname(spmd.kernels.__file__))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out[0] != str(ROOT / "kernels") and "site-packages" in out[0]
    assert out[1] == str(ROOT / "kernels")
