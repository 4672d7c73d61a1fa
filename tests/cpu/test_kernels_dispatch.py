"""Which implementation runs: SPMD_KERNELS, the device, and Triton imported only when used."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spmd.kernels import implementation, kernels_setting
from spmd.kernels.dispatch import on_device


@pytest.mark.parametrize("raw, expected", [(None, "auto"), ("", "auto"), ("torch", "torch"),
                                           (" Triton ", "triton"), ("AUTO", "auto")])
def test_setting(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv("SPMD_KERNELS", raising=False)
    else:
        monkeypatch.setenv("SPMD_KERNELS", raw)
    assert kernels_setting() == expected


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("SPMD_KERNELS", "cuda")
    with pytest.raises(ValueError, match="SPMD_KERNELS='cuda'.*auto, torch, triton"):
        implementation("cpu")


@pytest.mark.parametrize("setting, device, expected", [
    ("auto", "cpu", "torch"), ("auto", "cuda", "triton"), ("auto", "cuda:1", "triton"),
    ("auto", "meta", "torch"), ("torch", "cuda", "torch"), ("torch", "cpu", "torch"),
    ("triton", "cpu", "triton"), ("triton", "cuda", "triton"),
])
def test_implementation(monkeypatch, setting, device, expected):
    monkeypatch.setenv("SPMD_KERNELS", setting)
    assert implementation(device) == expected
    assert implementation(torch.device(device)) == expected


def test_forcing_triton_on_a_device_it_cannot_run_on_raises(monkeypatch):
    monkeypatch.setenv("SPMD_KERNELS", "triton")
    with pytest.raises(ValueError, match="not on meta"):
        implementation("meta")


def test_on_device_makes_a_cuda_device_current_and_does_nothing_on_cpu():
    cpu = on_device(torch.device("cpu"))
    assert isinstance(cpu, contextlib.nullcontext)
    with cpu as entered:
        assert entered is None
    cuda = on_device(torch.device("cuda", 1))  # built, not entered: no GPU is needed
    assert isinstance(cuda, torch.cuda.device) and cuda.idx == 1


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env={**os.environ, **env}, timeout=110)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_and_torch_path_do_not_import_triton():
    code = """
        import sys, torch, spmd.kernels as k
        out = k.pack([torch.ones(3), torch.ones(2)], scale=0.5)
        back = [torch.empty(3), torch.empty(2)]
        k.unpack(out, back, scale=4.0)
        params = [torch.ones(5)]
        k.sgd_step(params, out, None, lr=0.1)
        print("triton" in sys.modules, out.tolist(), [t.tolist() for t in back],
              [round(v, 6) for v in params[0].tolist()])
    """
    assert _run(code, SPMD_KERNELS="auto") == (
        "False [0.5, 0.5, 0.5, 0.5, 0.5] [[2.0, 2.0, 2.0], [2.0, 2.0]] "
        "[0.95, 0.95, 0.95, 0.95, 0.95]")


def test_kernels_run_in_the_form_the_device_needs_whatever_triton_interpret_says():
    """With TRITON_INTERPRET=1 set before Triton is imported, kernels decorate as
    interpreted; CPU launches use them, and the CUDA form is a compiled copy whose imported
    helper (``cast``) is compiled too."""
    code = """
        import torch
        import spmd.kernels as k
        from spmd.kernels import optim_triton
        from spmd.kernels.dispatch import launchable
        out = k.pack([torch.ones(3, dtype=torch.bfloat16)], dtype=torch.float32, scale=3.0)
        cuda = launchable(optim_triton.adamw_kernel, torch.device("cuda"))
        cpu = launchable(optim_triton.adamw_kernel, torch.device("cpu"))
        print(out.tolist(), cpu is optim_triton.adamw_kernel, type(cuda).__name__,
              type(cuda.fn.__globals__["cast"]).__name__)
    """
    assert _run(code, SPMD_KERNELS="triton", TRITON_INTERPRET="1") == (
        "[3.0, 3.0, 3.0] True JITFunction JITFunction")


def test_cpu_form_of_compiled_kernels_is_an_interpreted_copy():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from spmd.kernels import optim_triton, packing_triton
    from spmd.kernels.dispatch import launchable

    if isinstance(optim_triton.sgd_kernel, InterpretedFunction):
        pytest.skip("TRITON_INTERPRET=1 was set when the kernels were imported")
    cpu = launchable(optim_triton.sgd_kernel, torch.device("cpu"))
    assert isinstance(cpu, InterpretedFunction)
    assert isinstance(cpu.fn.__globals__["cast"], InterpretedFunction)
    assert isinstance(packing_triton.cast, JITFunction)  # the module itself is untouched
    assert launchable(optim_triton.sgd_kernel, torch.device("cuda")) is optim_triton.sgd_kernel
    assert launchable(optim_triton.sgd_kernel, torch.device("cpu")) is cpu
