"""Every Triton kernel compiles for an H100 (sm_90) here, without a GPU: Triton's wheel
ships ptxas, so the CPU suite catches what the interpreter cannot (a kernel that only
interprets), and checks that the aligned path really gets 16-byte loads and stores."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from spmd.kernels import optim_triton, packing_triton  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True, scope="module")
def _own_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # compile from scratch, away from ~/.triton
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        yield


def compile_ptx(kernel, flat: str, constexprs: dict) -> list[str]:
    """PTX of ``kernel`` with these constexprs, the tables and the flat buffer given as
    16-byte aligned pointers (as the JIT specialises torch's allocations)."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 was set when the kernels were imported")
    names = kernel.arg_names
    pointers = {"rows": "*i64", "chunks": "*i64", names[2]: flat}
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                        attrs=attrs),
                              target=H100, options={"enable_fp_fusion": False})
    return compiled.asm["ptx"].splitlines()


def memory_ops(ptx: list[str]) -> set[str]:
    return {word for line in ptx for word in line.split()
            if word.startswith(("ld.global", "st.global"))}


@pytest.mark.parametrize("strided, aligned", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("to_flat, accumulate", [(True, False), (False, False), (False, True)])
def test_copy_kernel_compiles(strided, aligned, to_flat, accumulate):
    flat_grid = to_flat and not aligned  # as packing_triton.plan chooses
    ptx = compile_ptx(packing_triton.copy_kernel, "*bf16", dict(
        WIDTH=10 if strided else 3, DTYPE=tl.float32, STRIDED=strided, ALIGNED=aligned,
        FLAT_GRID=flat_grid, TO_FLAT=to_flat, ACCUMULATE=accumulate, CHUNK=4096,
        BLOCK=1024))
    ops = memory_ops(ptx)
    # fp32 tensor side and bf16 flat side both move 16 bytes per instruction when aligned
    assert ({"ld.global.v4.b32", "st.global.v4.b32"} <= ops) == aligned, ops
    # packing on the flat buffer's grid: whole chunks store 8 bf16 (16 bytes) at a time
    # whatever the tensor's offset, while the tensor side is read an element at a time
    assert ("st.global.v4.b32" in ops) == (aligned or flat_grid), ops


@pytest.mark.parametrize("aligned", [False, True])
def test_sgd_kernel_compiles(aligned):
    ptx = compile_ptx(optim_triton.sgd_kernel, "*fp32", dict(
        P=tl.float32, B=tl.bfloat16, WEIGHT_DECAY=True, MOMENTUM=True, FIRST=False,
        NESTEROV=True, MAXIMIZE=True, ALIGNED=aligned, CHUNK=4096, BLOCK=1024))
    assert any("fma.rn.f32" in line for line in ptx)
    assert ("ld.global.v4.b32" in memory_ops(ptx)) == aligned


@pytest.mark.parametrize("aligned", [False, True])
def test_adamw_kernel_compiles(aligned):
    ptx = compile_ptx(optim_triton.adamw_kernel, "*bf16", dict(
        P=tl.float32, M=tl.float32, V=tl.float32, VMAX=tl.float16, WEIGHT_DECAY=True,
        SMALL_WEIGHT=True, AMSGRAD=True, MAXIMIZE=False, ALIGNED=aligned, CHUNK=4096,
        BLOCK=1024))
    text = "\n".join(ptx)
    assert "sqrt.rn.f32" in text and "div.rn.f32" in text  # IEEE, like torch on CUDA
    assert ("ld.global.v4.b32" in memory_ops(ptx)) == aligned


@pytest.mark.parametrize("wire, scaled", [("*bf16", False), ("*fp16", False), ("*fp32", False),
                                          ("*fp8e4nv", True), ("*fp8e5", True)])
def test_reduce_kernel_compiles(wire, scaled):
    """``reduce_chunks`` for every wire dtype; 16-byte vector loads for the 2-byte wires."""
    from spmd.kernels import reduce_triton

    kernel = reduce_triton.reduce_kernel
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET=1 was set when the kernels were imported")
    signature = {"chunks": wire, "scales": "*fp32", "out": "*bf16", "p": "i32", "n": "i32",
                 "scale": "fp32", "HAS_SCALES": "constexpr", "BLOCK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    attrs[(4,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature,
                                        constexprs={"HAS_SCALES": scaled, "BLOCK": 1024},
                                        attrs=attrs),
                              target=H100, options={"enable_fp_fusion": False})
    ops = memory_ops(compiled.asm["ptx"].splitlines())
    assert any(op.startswith("st.global") for op in ops), ops
    if wire in ("*bf16", "*fp16"):
        assert "ld.global.v4.b32" in ops, ops
