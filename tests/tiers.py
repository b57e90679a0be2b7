"""The slow tier: tests that ``make test`` leaves to ``make test-slow`` (CI runs both).

Chosen by time, from a ``pytest -n 2 --durations=0`` run of the whole suite (2026-12-07, at
c0ee71c with the session's changes, on the 2-core machine under load): the costliest tests, in
order, until they held 60 % of the suite's worker time (each over ~14 s there, ~5 s on a quiet
machine; at half, ``make test``'s pytest took 12 min 5 s in a fresh clone, too close to 15). They
are real multi-process gloo runs, the zoo's scripts, real ``torch.compile`` and quantised-library
runs, traces of catalog-sized models and the browser tests: the default tier keeps the faster
tests of the same rules, the slow tier the agreements with real runs at size. Tests marked
``@pytest.mark.slow`` in their files are in the slow tier too.

An entry names a test (``file::function``: every parametrisation) or one parametrisation
(``file::function[id]``). ``tests/conftest.py`` marks them, and refuses the run when an entry
names no test (a renamed test would fall back into the fast tier unnoticed).
"""

from __future__ import annotations

SLOW: tuple[str, ...] = (
    "tests/test_context_parallel_gloo.py::test_context_parallelism_agrees_with_a_real_run[cp2]",
    "tests/test_diffusion.py::test_lora_training_of_flux_uses_diffusers_own_switches",
    "tests/test_diffusion_pipelines.py::test_a_tiny_wan_video_pipeline_estimate_matches_its_real_cpu_run",
    "tests/test_diffusion_pipelines.py::test_the_cli_estimates_the_full_size_flux_pipeline",
    "tests/test_emulate.py::test_diffusers_cpu_offload_hooks_bring_each_model_in_for_its_call[model]",
    "tests/test_emulate.py::test_json_output_is_clean_when_the_script_prints",
    "tests/test_emulate.py::test_os_exit_ends_the_script_not_vramplan",
    "tests/test_engine_store.py::test_a_nearby_sequence_length_is_written_from_four_stored_traces",
    "tests/test_engine_store.py::test_fit_and_plan_run_ahead_in_forked_processes_with_the_serial_answer",
    "tests/test_engine_store.py::test_no_cache_writes_nothing_and_cache_command_reports_and_clears",
    "tests/test_float8_training.py::test_float8_recipes_trace_as_torchao_runs_on_the_cpu[tensorwise]",
    "tests/test_grpo.py::test_trls_own_grpo_script_under_vramplan_run_agrees_with_the_recipe",
    "tests/test_issue14_cli.py::test_item_3_estimate_and_fit_name_the_same_largest_batch",
    "tests/test_issue14_cli.py::test_lora_without_peft_falls_back_with_a_note",
    "tests/test_issue29_cli.py::test_a_gzip_bomb_is_refused_before_it_is_inflated",
    "tests/test_issue29_cli.py::test_a_gzip_bomb_of_valid_json_is_capped",
    "tests/test_issue29_cli.py::test_a_gzip_bomb_that_starts_as_a_pickle_stops_at_its_first_bad_byte",
    "tests/test_issue29_cli.py::test_a_traced_estimate_confirms_its_fix_with_a_trace",
    "tests/test_loop_knobs.py::test_liger_emulation_matches_liger_run_on_a_cpu_with_tritons_interpreter",
    "tests/test_pipeline_gloo.py::test_gloo_pipeline_run_agrees_with_trace",
    "tests/test_pipeline_gloo.py::test_lora_pipeline_agrees_with_a_real_run",
    "tests/test_pipeline_gloo.py::test_lora_under_pp_tp_fails_in_transformers_as_the_refusal_says",
    "tests/test_pipeline_gloo.py::test_pipeline_with_fsdp2_agrees_with_a_real_run",
    "tests/test_pipeline_gloo.py::test_pipeline_with_tensor_parallelism_agrees_with_a_real_run",
    "tests/test_pipeline_schedules.py::test_each_schedule_traces_the_analytic_states_per_rank[Interleaved1F1B]",
    "tests/test_pipeline_schedules.py::test_interleaved_holds_fewer_chunks_than_looped_bfs",
    "tests/test_pipeline_schedules.py::test_lora_pipeline_is_traced_and_matches_the_analytic[ZBVZeroBubble]",
    "tests/test_planner_changes.py::test_changes_are_the_whole_dicts_differences",
    "tests/test_planner_cli.py::test_rank_gpus_json",
    "tests/test_ppo.py::test_analytic_agrees_with_the_trace",
    "tests/test_ppo.py::test_ppo_under_fsdp2_gloo_run_agrees_with_trace",
    "tests/test_ppo.py::test_the_reward_model_is_bf16_and_sharded_under_verl_ppo",
    "tests/test_preference.py::test_a_reference_under_ddp_is_a_replica_in_both_methods[grpo]",
    "tests/test_preference.py::test_pairs_double_the_sequences_and_layers_are_replicated_exactly",
    "tests/test_quant_formats.py::test_from_pretrained_quantization_config_runs_as_its_estimate[ct-fp8-extra5]",
    "tests/test_quant_formats.py::test_from_pretrained_quantization_config_runs_as_its_estimate[ct-w4a16-extra4]",
    "tests/test_quant_formats.py::test_from_pretrained_quantization_config_runs_as_its_estimate[int8-extra3]",
    "tests/test_quant_formats.py::test_from_pretrained_quantization_config_runs_as_its_estimate[nf4-extra2]",
    "tests/test_quant_formats.py::test_stored_tensors_are_the_librarys[hqq]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[openrlhf-grpo-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[openrlhf-ppo-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[trl-dpo-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[trl-grpo-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[trl-kto-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[unsloth-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[unsloth-qlora]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[verl-grpo-none]",
    "tests/test_recipes.py::test_every_recipe_traces_llama[verl-ppo-none]",
    "tests/test_rl_fsdp1.py::test_dpo_with_a_reference_under_fsdp_agrees_with_a_real_gloo_run[fsdp2]",
    "tests/test_rl_fsdp1.py::test_grpo_reference_under_fsdp_agrees_with_trl_prepare_fsdp_on_gloo",
    "tests/test_rl_fsdp1.py::test_grpo_under_fsdp1_and_ddp_agrees_with_a_real_gloo_run",
    "tests/test_script_launch.py::test_fsdp1_script_runs_with_flat_sharded_states",
    "tests/test_script_launch.py::test_modules_run_as_python_dash_m_runs_them",
    "tests/test_script_run.py::test_cli_bad_input_is_one_line_exit_2[argv0-init_process_group]",
    "tests/test_script_run.py::test_cli_runs_a_script_and_reports_json",
    "tests/test_script_run.py::test_from_pretrained_builds_from_the_config_without_weights",
    "tests/test_script_run.py::test_from_pretrained_without_a_gpu_device_map_loads_on_the_host",
    "tests/test_search_answers.py::test_fit_lora_boundaries",
    "tests/test_search_answers.py::test_generate_above_capacity_keeps_its_retries_and_ooms",
    "tests/test_search_answers.py::test_generate_verdict_largest_batch",
    "tests/test_search_answers.py::test_train_verdict_sliding_window_model",
    "tests/test_serving_versions.py::test_multimodal_profile_per_release",
    "tests/test_startup.py::test_transformers_import_structure_is_unchanged_by_the_wider_cache_and_the_trimmed_fetch",
    "tests/test_torchtitan.py::test_torchtitan_debug_model_on_one_gpu",
    "tests/test_torchtitan.py::test_torchtitan_expert_parallel_on_two_gpus",
    "tests/test_torchtitan.py::test_torchtitan_llama3_8b_on_eight_gpus",
    "tests/test_torchtitan.py::test_torchtitan_moe_layer_expert_parallel_agrees_with_gloo",
    "tests/test_trace_async_tp.py::test_a_tp_script_with_async_tp_is_refused_in_one_line",
    "tests/test_trace_async_tp.py::test_torchtitan_async_tp_is_refused_in_one_line",
    "tests/test_trace_categories.py::test_vectorised_equals_reference",
    "tests/test_trace_compile.py::test_compiled_checkpointed_block_saves_what_real_torch_compile_saves",
    "tests/test_trace_compile.py::test_compiled_selective_checkpoint_saves_what_real_torch_compile_saves",
    "tests/test_trace_compile.py::test_saved_activations_match_real_torch_compile_on_cpu[eager-True]",
    "tests/test_trace_decode.py::test_fast_decode_gives_the_same_event_log[fp32-mixtral-8x7b]",
    "tests/test_trace_decode.py::test_llama_8b_64_tokens_same_peak_as_the_full_trace",
    "tests/test_trace_forked.py::test_forked_expert_cut_traces_keep_their_note",
    "tests/test_trace_forked.py::test_forked_traces_equal_serial_ones[llama-3.1-8b-w1]",
    "tests/test_trace_fsdp.py::test_catalog_llama_states_equal_analytic[llama-3.1-70b-64-3]",
    "tests/test_trace_fsdp.py::test_fsdp2_full_size_analytic_peak_is_the_traces[llama-3.2-1b-sft-dp4-z2]",
    "tests/test_trace_fsdp.py::test_fsdp2_full_size_analytic_peak_is_the_traces[llama-3.2-1b-dpo-dp4-z2]",
    "tests/test_trace_fsdp.py::test_fsdp2_full_size_analytic_peak_is_the_traces[llama-3.2-1b-dpo-dp2-z2]",
    "tests/test_trace_fsdp.py::test_fsdp2_full_size_analytic_peak_is_the_traces[8b-4-layers-lora-dp8-z3]",
    "tests/test_trace_fsdp_compile.py::test_fsdp2_with_compiled_blocks_agrees_with_a_real_compiled_gloo_run",
    "tests/test_trace_fsdp_symm_mem.py::test_torchtitan_fsdp_symm_mem_is_refused_in_one_line",
    "tests/test_trace_gloo.py::test_gloo_run_agrees_with_trace",
    "tests/test_trace_gloo.py::test_lora_under_tensor_parallelism_gloo_run_agrees_with_trace",
    "tests/test_trace_gloo.py::test_tensor_parallel_generation_gloo_run_agrees_with_trace",
    "tests/test_trace_memtracker.py::test_peak_matches_memtracker_within_one_percent[cnn]",
    "tests/test_trace_microsteps.py::test_a_catalog_model_writes_its_micro_steps_too",
    "tests/test_trace_microsteps.py::test_written_micro_steps_equal_traced_ones[grpo]",
    "tests/test_trace_microsteps.py::test_written_micro_steps_equal_traced_ones[lora-checkpointed]",
    "tests/test_trace_nearby.py::test_batch_one_and_activation_offload_are_refused",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-0]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-2]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-4]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-5]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-6]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[gpt2-7]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-11]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-12]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-13]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-14]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-15]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-16]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-17]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-18]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[llama-3.2-1b-20]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[qwen2.5-0.5b-8]",
    "tests/test_trace_nearby.py::test_written_trace_equals_a_fresh_one[qwen2.5-0.5b-9]",
    "tests/test_trace_offload.py::test_offload_composes_with_compile_and_checkpointing",
    "tests/test_trace_pipeline_parallel.py::test_analytic_holds_what_the_trace_holds_under_pipeline_context_parallelism",
    "tests/test_trace_pipeline_parallel.py::test_analytic_holds_what_the_trace_holds_under_pipeline_tensor_parallelism[4-256-3-bf16-mixed-parallel0]",
    "tests/test_trace_replicate.py::test_experts_and_layers_replicated_together",
    "tests/test_trace_reuse.py::test_a_borrowed_model_traces_as_a_fresh_build[mixtral]",
    "tests/test_trace_tensor_parallel.py::test_llama_tp8_states_equal_the_analytic_figures_exactly",
    "tests/test_trace_tensor_parallel.py::test_qwen2_5_0_5b_tp2_weights_equal_the_analytic_figures_to_the_byte",
    "tests/test_trace_tp_compile.py::test_real_tp_with_compiled_blocks_fails_in_its_first_backward_and_runs_with_the_input_waited",
    "tests/test_trace_tp_fsdp.py::test_catalog_8b_tp8_ddp8_states_equal_analytic",
    "tests/test_trace_tp_fsdp.py::test_catalog_llama_tp_fsdp_states_equal_analytic[llama-3.1-70b-tp8-dp64-z2]",
    "tests/test_trace_tp_fsdp.py::test_catalog_llama_tp_fsdp_states_equal_analytic[llama-3.1-70b-tp8-dp64-z3]",
    "tests/test_trace_tp_fsdp.py::test_catalog_llama_tp_fsdp_states_equal_analytic[llama-3.1-70b-tp8-dp8-z3]",
    "tests/test_vlm.py::test_preference_and_rl_objectives_with_images",
    "tests/test_web_api.py::test_gpu_ranking_is_the_cli_json",
    "tests/test_web_browser.py::test_a_burst_of_changes_stops_the_stale_traces",
    "tests/test_web_browser.py::test_a_config_nobody_can_build_is_refused_with_its_field[desktop]",
    "tests/test_web_browser.py::test_nothing_scrolls_sideways_and_chart_text_is_readable[desktop]",
    "tests/test_web_browser.py::test_the_timeline_always_answers_the_inputs_shown[desktop]",
    "tests/test_web_server.py::test_workers_end_with_the_server[terminate]",
)


def slow_entry(nodeid: str) -> str | None:
    """The entry of :data:`SLOW` that names ``nodeid`` (the test or its function), else None."""
    if nodeid in _EXACT:
        return nodeid
    function = nodeid.split("[", 1)[0]
    return function if function in _EXACT else None


_EXACT = frozenset(SLOW)
