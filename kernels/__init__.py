"""spmd.kernels: Triton kernels for the memory-bound work around collectives."""

__all__: list[str] = []
