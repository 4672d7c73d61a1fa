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


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_dependencies_point_one_way():
    allowed = {  # folder -> the spmd packages it may import
        "runtime": ("spmd.runtime",),
        "kernels": ("spmd.kernels", "spmd.runtime"),
        "lowering": ("spmd.lowering", "spmd.kernels", "spmd.runtime"),
    }
    for folder, ok in allowed.items():
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                if name == "spmd" or name.startswith("spmd."):
                    assert name.startswith(ok), f"{path.relative_to(ROOT)} imports {name}"
                assert name.split(".")[0] not in ("runtime", "lowering", "kernels"), (
                    f"{path.relative_to(ROOT)}: bare import {name}; use spmd.{name}")


def _module_name(path: pathlib.Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rel = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = [LAYERS[folder], *rel]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("folder", ["spmd", "lowering"])
def test_no_import_cycles_within_a_layer(folder):
    """Imports anywhere in a module (function-local ones too) form no cycle: each module
    of the compiler can be read, and changed, before the ones that import it."""
    import networkx as nx

    modules = {_module_name(p): p for p in (ROOT / folder).rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for imported in _imports(path):
            target = imported if imported in modules else None
            if target is None and imported.rsplit(".", 1)[0] in modules:
                target = imported.rsplit(".", 1)[0]
            if target is not None and target != name and not target.endswith(("spmd",)):
                graph.add_edge(name, target)
    cycles = list(nx.simple_cycles(graph))
    assert cycles == [], f"import cycles: {cycles[:3]}"


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
