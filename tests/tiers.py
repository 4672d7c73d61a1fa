"""Which tests ``make test`` (CI: 20 minutes on 2 cores) leaves to the long profile, and
which ``make test-fast`` runs.

``SPMD_TESTS=all make test`` (or ``make test-long``) runs everything; ``make test-fast``
(``SPMD_TESTS=fast``) runs :data:`FAST`, a few minutes' edit loop. A test leaves CI
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
    # 2026-11-29: CI measured 1224 s on quiet cores with these in (1496 tests); each
    # leaves one case of a class CI keeps another case of
    "tests/cpu/test_training_loops.py::test_loop_equals_one_process[context_parallel_llama-ddp]": (
        35, "context_parallel-ddp (the project's transformer), graph test_context_parallel"),
    "tests/cpu/test_training_loops.py::test_loop_equals_one_process[sequence_parallel_llama-ddp]": (
        35, "sequence_parallel-ddp (the project's transformer), graph test_sequence_parallel"),
    "tests/cpu/test_training_loops.py::test_loop_equals_one_process[changing_batch_encoder-ddp]": (
        16, "changing_batch_encoder-fsdp and changing_batch-ddp"),
    # 2026-11-29 (afternoon): room for test_reshard_groups (21 s)
    "tests/cpu/test_launch.py::test_a_hanging_rank_is_reported_after_the_timeout[forkserver-15]": (
        15, "the thread case of the same test; every spawn test starts forkserver ranks"),
    "tests/cpu/test_parallelize_equivalence.py::test_plans_record_buckets_frozen_and_fallbacks[3-ranks]": (
        23, "the same test on 2 ranks; 3 ranks in test_sync_batchnorm"),
    # every dp2xtp2 case shares one spawn (18 s)
    **{f"tests/cpu/test_tp.py::{name}[dp2xtp2]": (18, "tp2 and fsdp2xtp2 of the same test")
       for name in ("test_parameters_are_pieces_and_state_dicts_whole",
                    "test_megatron_layers_cost_one_all_reduce_each_way",
                    "test_an_op_without_a_rule_trains_like_one_process",
                    "test_clipping_uses_the_whole_gradients_norm")},
    "tests/torch_suites/test_torch_rpc.py::TensorPipeDistAutogradTest::test_backward_simple": (
        20, "test_rpc_autograd; make torch-suites runs torch's whole RPC suite"),
    "tests/torch_suites/test_torch_c10d.py::TestDistBackendWithSpawn::test_send_recv": (
        10, "test_p2p; torch's all_reduce and all_gather tests stay"),
    "tests/cpu/test_fuzz_loops.py::test_drawn_loops_equal_one_process": (
        18, "the fixed loops, which make every move (SPMD_FUZZ=full draws 200)"),
    "tests/graph/test_context_parallel.py::test_activation_memory_per_rank_shrinks_with_the_ranks": (
        10, "test_memory_prediction, the module's other context-parallel plans"),
    "tests/graph/test_sequence_parallel.py::test_activations_saved_outside_the_split_layers_shrink": (
        10, "test_memory_prediction, the module's other sequence-parallel plans"),
    "tests/cpu/test_parallelize_inductor.py::test_inductor_compiles_tensor_parallel_graphs_for_their_pieces": (
        13, "the module's inductor test on the data-parallel path"),
    "tests/cpu/test_join.py::test_uneven_inputs_end_like_torch_ddp_join[batchnorm]": (
        7, "the mlp and sparse cases of the same test"),
    "tests/graph/test_hf_preset.py::test_each_model_plans_on_a_simulated_mesh[mistral-2]": (
        5, "llama's (mistral has its structure) and gpt2's"),
    "tests/graph/test_hf_preset.py::test_each_model_plans_on_a_simulated_mesh[qwen2-2]": (
        5, "llama's (qwen2 has its structure) and gpt2's"),
    # 2026-12-04: many hosts (issue 44); CI keeps each layout on loopback hosts
    # (test_across_hosts) and ddp/hsdp across network namespaces
    "tests/cpu/test_hosts.py::test_every_strategy_on_two_shaped_hosts_equals_one_process[fsdp-zero1-zero2-tp]": (
        15, "test_across_hosts (the same layouts on loopback hosts); [ddp-hsdp] across namespaces"),
    "tests/cpu/test_hosts.py::test_every_strategy_on_two_shaped_hosts_equals_one_process[pp-cp-auto]": (
        17, "test_across_hosts (the same layouts on loopback hosts); [ddp-hsdp] across namespaces"),
    "tests/cpu/test_across_hosts.py::test_data_parallel_across_hosts_equals_one_process_in_two_levels_and_flat[never]": (
        9, "the flat ring is what every other data-parallel test runs; [always] stays"),
    "tests/cpu/test_hosts.py::test_a_job_spans_two_hosts_joining_in_any_order[torchrun]": (
        12, "the [spmd] case; test_rendezvous joins torchrun's agent store"),
    # 2026-12-05: a host cut off mid-step (the collective's timeout, then the store's)
    "tests/cpu/test_faults_hosts.py::test_a_host_cut_off_mid_step": (
        55, "test_a_lost_host_and_the_job_continues_on_the_rest (a host lost, the job on "
            "the rest) and the stalled rank across hosts (a timeout named, a restart)"),
    "tests/cpu/test_faults_hosts.py::test_a_rank_that_stalls_past_the_timeout_is_named_and_restarted[ddp]": (
        20, "its [fsdp] case; the fault matrix on local ranks covers every layout"),
    "tests/cpu/test_faults_hosts.py::test_a_rank_that_stalls_past_the_timeout_is_named_and_restarted[hsdp]": (
        20, "its [fsdp] case; the fault matrix on local ranks covers every layout"),
    "tests/cpu/test_faults_hosts.py::test_a_rank_that_stalls_past_the_timeout_is_named_and_restarted[tp]": (
        20, "its [fsdp] case; the fault matrix on local ranks covers every layout"),
    "tests/cpu/test_faults_hosts.py::test_a_rank_that_stalls_past_the_timeout_is_named_and_restarted[pp]": (
        20, "its [fsdp] case; the fault matrix on local ranks covers every layout"),
    "tests/cpu/test_faults_hosts.py::test_the_store_hosts_loss_on_three_hosts_elects_a_new_one": (
        21, "test_the_store_hosts_death_elects_a_new_one_and_the_run_goes_on (three agents "
            "over 127.0.0.1: the same election, one address)"),
    "tests/cpu/test_checkpoint_manager.py::test_the_loops_users_write_restart_bit_for_bit[zero2]": (
        18, "its [ddp] (the safety net's accumulation) and [fsdp] (sharded state) cases"),
    # 2026-12-05: live recovery of replicas that are jobs of their own
    "tests/cpu/test_ft.py::test_a_replica_sharded_inside_loses_a_rank_and_comes_back_healed[ddp]": (
        17, "its [fsdp] case (the same protocol, the shards' groups), and the stalled "
            "rank's test"),
    # 2026-12-05: a rank killed at each point of a step under each layout (24 cases)
    "tests/cpu/test_checkpoint_manager.py::test_the_fault_matrix": (
        420, "test_a_killed_rank_restarts_and_finishes_bit_for_bit (a kill in backward "
             "under fsdp, one during a checkpoint's write under ddp)"),
    # 2026-12-05: expert parallelism; CI keeps ddp-routed, fsdp-skewed, zero2-routed and
    # the 4-rank hsdp with the experts along "dp" (skewed)
    **{f"tests/cpu/test_experts.py::test_expert_parallel_model_trains_like_one_process[{c}]": (
        s, "the same test's cases CI keeps (each layout routed or skewed once)")
       for c, s in (("ddp-skewed", 7), ("fsdp-routed", 8), ("zero2-skewed", 8),
                    ("hsdp-ep-on-fsdp-routed", 18), ("hsdp-ep-on-fsdp-skewed", 18),
                    ("hsdp-ep-on-dp-routed", 17))},
    "tests/cpu/test_experts.py::test_a_checkpoint_split_by_expert_resumes_under_another_layout[fsdp]": (
        7, "its [fsdp x ep] case (the same restore of pieces split by expert)"),
    "tests/cpu/test_experts.py::test_expert_parallel_model_trains_like_one_process[zero2-routed]": (
        9, "test_fuzz_loops' fixed zero2 loop with its experts split (no_sync, a frozen "
           "layer, an eager loss term)"),
    # 2026-12-05: expert parallelism beside tensor parallelism and in pipelines
    "tests/cpu/test_experts_compose.py::test_expert_parallel_beside_tensor_parallelism_trains_like_one_process[ddp x ep x tp]": (
        20, "its [fsdp x ep x etp] case (the experts split on 'tp' too, compiled) and "
            "test_hf_sweep's qwen3_moe under ep x tp"),
    "tests/cpu/test_experts_compose.py::test_expert_parallel_stages_of_a_pipeline_train_like_one_process[own fsdp gpipe]": (
        9, "its [own ddp 1f1b] and [mixtral ddp 1f1b] cases (the same stages' experts)"),
    "tests/cpu/test_experts_compose.py::test_the_automatic_layout_plans_each_layout_with_and_without_expert_parallelism": (
        15, "test_the_automatic_layout_with_experts_trains_like_one_process (a live search "
            "with the experts split) and tests/cpu/test_auto.py"),
    # 2026-12-05: expert parallelism beside context parallelism
    "tests/cpu/test_experts_compose.py::test_expert_parallel_beside_context_parallelism_trains_like_one_process[fsdp x ep x cp]": (
        19, "its [ddp x ep x cp] case (the planned graph, each rank routing its part) "
            "and test_hf_sweep's deepseek_v3 under cp x ep; the eager path beside cp: "
            "tests/cpu/test_training_loops.py"),
    "tests/cpu/test_experts_compose.py::test_expert_parallel_stages_of_a_pipeline_train_like_one_process[mixtral ddp 1f1b]": (
        16, "its [own ddp 1f1b] case (the same stages' experts); every transformers MoE "
            "family under pp x ep: the sweep (SPMD_HF=full)"),
    "tests/cpu/test_checkpoint_manager.py::test_the_loops_users_write_restart_bit_for_bit[ddp]": (
        20, "its [fsdp] case (the same loops, the state sharded) and "
            "test_a_killed_rank_restarts_and_finishes_bit_for_bit[ddp-checkpoint]"),
    # 2026-12-05: room for expert parallelism's tests (CI measured 1035 s before them)
    "tests/cpu/test_across_hosts.py::test_the_loops_users_write_across_hosts_in_two_levels": (
        26, "test_training_loops (the same loops on one host) and "
            "test_data_parallel_across_hosts_equals_one_process_in_two_levels_and_flat"),
    "tests/cpu/test_ft.py::test_a_replica_whose_rank_stalls_names_it_and_is_replaced": (
        24, "test_a_replica_sharded_inside_loses_a_rank_and_comes_back_healed[fsdp] (a rank "
            "of a replica lost, restarted, healed) and the stalled replica's test"),
    "tests/cpu/test_experts_compose.py::test_transformers_families_under_ep_with_the_batch_size_changing[qwen2_moe+qwen3_moe+olmoe+gpt_oss]": (
        42, "its [deepseek_v3+mixtral] case (the same path, the eager graphs of a "
            "transformers MoE), and those families' CI sweep cells"),
    "tests/cpu/test_experts_compose.py::test_transformers_families_under_ep_with_the_batch_size_changing[deepseek_v3-headroom]": (
        18, "test_experts_headroom's 2-rank test (every pair to one rank, ddp and fsdp, the rerun "
            "with dropout) on the own model"),
    "tests/cpu/test_experts_compose.py::test_expert_parallel_beside_context_parallelism_trains_like_one_process[ddp x ep x cp, headroom 1]": (
        15, "its [ddp x ep x cp] case and test_experts_headroom's 2-rank test"),
    "tests/cpu/test_experts_headroom.py::test_the_default_headroom_on_four_expert_ranks_grows_where_routing_is_skewed": (
        13, "its test_a_headroom_bounds_the_received_rows_and_grows_where_a_forward_overflows "
            "(the same overflow and rerun on 2 ranks) and the default's cases, planned"),
    "tests/cpu/test_experts_compose.py::test_expert_parallel_beside_context_parallelism_in_the_loops_users_write": (
        14, "test_expert_parallel_beside_context_parallelism_trains_like_one_process[ddp x "
            "ep x cp] and test_fuzz_loops' expert loops (accumulation, frozen layers)"),
    "tests/cpu/test_hf_sweep.py::test_a_family_trains_like_one_process_or_is_refused[granite_swa-fsdp x tp]": (
        16, "granite_swa-tp (the sinks split by their own key) and test_tp's fsdp2xtp2"),
}


# make test-fast: under 3 minutes on 2 quiet cores (about 140 s of tests, measured
# 2026-11-29, plus collection), a slice of every layer: the runtime's collectives,
# stores, rendezvous and point-to-point, the size check; the compiler's graph passes
# without processes; and whole trainings against one process (steps, zero, pipelines,
# checkpoints across layouts), cheap ones
FAST: tuple[str, ...] = tuple(
    [f"tests/cpu/test_{name}.py" for name in (
        "bad_input", "collectives", "groups", "p2p", "rendezvous", "tcp_store",
        "store_processes", "ring_attention", "disagreement", "rpc_api", "kernels_layout",
        "kernels_dispatch", "step_semantics", "parallelize_step", "pipeline_loops",
        "fuzz_pipelines", "fuzz_checkpoints", "zero", "hierarchical")]
    + [f"tests/graph/test_{name}.py" for name in (
        "redistribute", "flat", "ownership", "pipeline_schedules", "zoo", "step_refusals",
        "partition", "empty_backward", "schedule", "write_through", "checkpoint_chunks",
        "clip", "passes", "ir", "lifetimes", "vocab_parallel", "autolayout",
        "loss_parallel", "topology")])


def is_long(nodeid: str) -> bool:
    return any(nodeid.startswith(prefix) for prefix in LONG)


def is_fast(nodeid: str) -> bool:
    return nodeid.startswith(FAST) and not is_long(nodeid)
