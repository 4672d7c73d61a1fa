"""Which tests ``make test`` (CI: 20 minutes on 2 cores) leaves to the long profile.

``SPMD_TESTS=all make test`` (or ``make test-long``) runs everything. A test leaves CI
only when something in CI covers the same class of behaviour more cheaply; each entry
says what, and the seconds it took on 2 quiet cores (2026-11-29)."""

from __future__ import annotations

# node-id prefix -> (quiet seconds, what in CI covers it)
LONG: dict[str, tuple[float, str]] = {
    # whole modules: CI keeps a cheaper test of the same class (named after each)
    "tests/cpu/test_zoo.py": (245, "graph test_zoo plans every model; test_tp, "
                              "test_training_loops, test_checkpoint_matrix train against one process"),
    "tests/cpu/test_pipeline.py": (255, "test_pipeline_loops, test_fuzz_pipelines (pp=2, all "
                                   "four schedules), graph test_pipeline_cut"),
    "tests/cpu/test_fsdp.py": (144, "test_shard_placement, test_after_parallelize, "
                               "test_checkpoint_matrix, test_zero (fsdp/hsdp against one process)"),
    "tests/cpu/test_auto.py": (88, "graph test_auto (the search, no processes)"),
    "tests/graph/test_auto_plan.py": (82, "graph test_auto"),
    "tests/cpu/test_loss_parallel.py": (77, "graph test_vocab_parallel, test_tp"),
    "tests/cpu/test_notebooks.py": (61, "the plan views' own tests (graph test_views etc.)"),
    "tests/cpu/test_fsdp_checkpoint.py": (63, "test_checkpoint_matrix (every layout, n to m ranks)"),
    "tests/graph/test_fsdp_graph.py": (95, "test_shard_placement, graph test_verify"),
    "tests/graph/test_llama_rules.py": (57, "graph test_tp_rules, test_training_loops' llama loops"),
    "tests/graph/test_roofline.py": (44, "test_memory_prediction, test_hardware_fit"),
    "tests/graph/test_zoo_blocks.py": (36, "graph test_zoo"),
    "tests/graph/test_hardware.py": (35, "test_hardware_fit, test_memory_prediction"),
    "tests/cpu/test_compressed.py": (41, "graph tests of the compressed all-reduce's kernels"),
    # single tests
    "tests/cpu/test_kernels_packing.py::test_thousands_of_tiny_tensors[triton]": (
        28, "the same test on the torch reference, and the packing tests with Triton"),
    "tests/cpu/test_kernels_optim.py::test_thousands_of_tiny_params[triton]": (
        20, "the same test on the torch reference"),
    "tests/cpu/test_parallelize_equivalence.py::test_parallelize_equals_one_process_and_ddp[3-ranks": (
        38, "the 2-rank cases; 3 ranks in test_sync_batchnorm and test_fuzz_loops"),
    "tests/cpu/test_parallelize_equivalence.py::test_parallelize_equals_one_process_and_ddp[2-ranks-mlp-sgd": (
        15, "the module's other 2-rank cases"),
    "tests/cpu/test_tp.py::test_tensor_parallel_trains_like_one_process[dp2xtp2]": (
        21, "fsdp2xtp2 and tp2 of the same test"),
    "tests/cpu/test_training_loops.py::test_loop_equals_one_process[activation_checkpointing_llama": (
        42, "activation_checkpointing (ddp, fsdp) and the checkpointed-plan test"),
    "tests/torch_suites/test_torch_rpc.py::TensorPipeDistOptimizerTest::test_dist_optim": (
        19, "test_rpc_training, test_rpc_autograd"),
    "tests/torch_suites/test_torch_rpc.py::TensorPipeRpcTest::test_rref_forward_chain": (
        18, "test_rpc_rref"),
    "tests/torch_suites/test_torch_rpc.py::TensorPipeDdpComparisonTest::test_ddp_comparison": (
        16, "test_rpc_ddp"),
}


def is_long(nodeid: str) -> bool:
    return any(nodeid.startswith(prefix) for prefix in LONG)
