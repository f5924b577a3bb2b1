"""Mutation testing of mini_moe's core (issue 52 §3): routing.py, layer.py, losses.py.

Generates first-order mutants with ``ast`` and runs a fast, targeted pytest subset against each
one in a throw-away copy of the repository (``--work``, default /tmp/mutants-work); the
repository's own ``mini_moe/`` is never written. A mutant is *killed* when the subset fails,
*timeout* when it runs past ``--timeout-factor`` times the unmutated run (counted as killed),
*error* when the mutated module does not even import (counted as killed, reported apart), and
*survived* when every test passes.

Mutation operators (each mutant changes one expression; the id is ``module:line:col:operator``):

* ``binop``   arithmetic swap: + <-> -, * -> /, / -> *, // -> *, ** -> *, % -> //, | <-> &;
* ``compare`` < <-> <=, > <-> >=, == <-> !=, in <-> not in, is <-> is not;
* ``boolop``  and <-> or;
* ``unary``   removal of a unary minus or of ``not``;
* ``const``   an int n -> n + 1 (0 -> 1, 1 -> 0), a float x -> 2 x (0.0 -> 1.0), True <-> False;
* ``axis``    ``axis=a`` -> the neighbouring axis (a - 1, or a + 1 for a = -1 ... stays negative);
* ``call``    ``max`` <-> ``min``, ``argmax`` <-> ``argmin``, ``maximum`` <-> ``minimum``,
  ``sum`` <-> ``mean``, ``any`` <-> ``all``, ``zeros`` <-> ``ones`` (also ``_like``), ``floor`` <->
  ``ceil``, ``argsort`` -> its reverse;
* ``nostopgrad`` ``jax.lax.stop_gradient(x)`` -> ``x``;
* ``where``   ``jnp.where(c, a, b)`` -> ``jnp.where(c, b, a)``;
* ``ifnot``   ``if c:`` -> ``if not (c):`` (not on an ``if`` whose body only raises: those are
  input checks, whose messages the tests pin separately);
* ``slice``   a slice's upper bound u -> u - 1, lower bound l -> l + 1;
* ``kwstr``   ``mode="drop"`` <-> ``"clip"``, ``side="right"`` <-> ``"left"``.

Skipped: docstrings and every other string, f-strings, ``raise`` statements (their messages and
arguments), the tests of ``if``s whose body only raises (input checks), type annotations,
imports, and the integer literals of shape plumbing (``x.shape[-1]``, ``reshape(-1, ...)``),
whose mutants fail on a shape rather than on a value. The set is sorted by id; with
``--sample N`` it is cut deterministically to the N mutants with the smallest sha1(id) hex
digest, and the rule is recorded in the report.

Each mutant runs first against ``SUITE[module]``, a fast subset of the existing tests; a mutant
that survives it runs against ``NEW_TESTS`` (tests/test_mutant_killers.py, the tests added to kill
survivors), and the report classifies it "killed-by-new-test", "equivalent" (``EQUIVALENT``, with
the reason why no input can tell it from the original) or "survived" (``SURVIVOR_NOTES``).

Everything runs on one CPU core: ``taskset -c 1``, ``JAX_PLATFORMS=cpu``, ``XLA_FLAGS`` below,
``-p no:xdist``. Each finished mutant is appended to a JSONL file (``--results``) and ids already
there are skipped, so a run can be stopped and resumed (``--rerun`` runs them again).

    .venv/bin/python .ci/mutants.py --list --sample 160      # the mutants, without running them
    .venv/bin/python .ci/mutants.py --module losses --limit 10
    .venv/bin/python .ci/mutants.py --resume --sample 160    # every mutant not yet in the JSONL
    .venv/bin/python .ci/mutants.py --only 'routing:180:4:compare' --rerun
    .venv/bin/python .ci/mutants.py --report --sample 160    # the JSONL -> the JSON report
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The modules mutated (paths under mini_moe/ without .py): issue 52's three, and issue 66 §3's routers/,
#: inference and upcycle.
MODULES = ("routing", "layer", "losses", "routers/affinities", "routers/allocations", "routers/balancing",
           "routers/adaptive", "routers/null", "routers/controls", "routers/papers", "routers/stateful",
           "routers/registry", "inference", "upcycle")
RESULTS = ROOT / "mini_moe" / "results"

# The fast test subset per module from the existing suite, chosen by timing tests/test_routing.py,
# test_layer.py, test_losses.py and test_bug_zoo.py on one core (--durations=0; the whole four files
# take about 125 s, these subsets 15-35 s with start-up): the tests that call the module's functions
# directly, without the ones that only re-check jit/vmap or other modules' capacity.
SUITE = {
    "routing": [
        "tests/test_routing.py::test_capacity_known_values",
        "tests/test_routing.py::test_capacity_rounds_halves_up_exactly",
        "tests/test_routing.py::test_capacity_rejects_bad_input",
        "tests/test_routing.py::test_token_choice_first_choices_before_second_choices",
        "tests/test_routing.py::test_token_choice_drops_are_not_rerouted_and_bpr_reorders",
        "tests/test_routing.py::test_token_choice_bpr_uses_the_same_order_in_every_round",
        "tests/test_routing.py::test_expert_choice_known_example",
        "tests/test_routing.py::test_pick_load_and_max_violation_count_the_demand_before_capacity",
        "tests/test_routing.py::test_bad_inputs_raise_value_error",
        "tests/test_routing.py::test_soft_routing_normalisations",
        "tests/test_routing.py::test_combine_gradient_flows_to_combine_scores_only_at_picks",
        "tests/test_routing.py::test_token_choice_invariants",
        "tests/test_routing.py::test_token_choice_equals_algorithm_1_loop",
        "tests/test_routing.py::test_expert_choice_invariants_and_loop",
        "tests/test_bug_zoo.py::test_vllm_13474_group_limited_routing_never_picks_an_excluded_expert",
        "tests/test_bug_zoo.py::test_deepspeed_1658_tokens_over_capacity_are_dropped",
        "tests/test_bug_zoo.py::test_deepspeed_7986_a_full_expert_keeps_its_best_tokens_even_with_negative_logits",
        "tests/test_bug_zoo.py::test_megatron_1513_the_sequence_wise_loss_counts_the_top_k_not_what_capacity_kept",
    ],
    "layer": [
        "tests/test_dropless.py::test_megablox_kernel_equals_ragged_dot",  # the only test of the TPU kernel's branch (Pallas interpreter)
        "tests/test_layer.py::test_bad_inputs",
        "tests/test_layer.py::test_moe_sorted_rejects_bad_arguments",
        # the null experts' identity and constant kinds (layer:370:11 and :372:11 survived without it)
        "tests/test_null_experts.py::test_identity_expert_is_the_identity_and_constant_expert_is_moe_plus_plus",
        "tests/test_layer.py::test_einsum_and_gather_paths_agree_with_gradients",
        "tests/test_layer.py::test_softmax_token_choice_with_full_capacity_is_eq_1",
        "tests/test_layer.py::test_soft_moe_layer_is_paper_002_eq_1_2",
        "tests/test_layer.py::test_moe_sorted_equals_dropless_token_choice",
        "tests/test_mutant_killers.py::test_a_constant_null_expert_starts_halfway_between_the_token_and_its_vector",  # layer:361:70
    ],
    "losses": [
        "tests/test_losses.py",
        "tests/test_bug_zoo.py::test_transformers_28115_switch_loss_uses_the_full_softmax",
        "tests/test_bug_zoo.py::test_megatron_5798_the_sequence_wise_loss_does_not_depend_on_the_batch_size",
        "tests/test_bug_zoo.py::test_megatron_1513_the_sequence_wise_loss_counts_the_top_k_not_what_capacity_kept",
        "tests/test_mutant_killers.py::test_the_null_aware_switch_loss_is_one_on_an_even_load",  # losses:150:28
    ],
}
# Issue 66 §3: routers/, inference and upcycle. Every router module runs ROUTERS_CORE (the golden outputs
# of every registered router, tests/data/router_golden.npz, and the routers' known-value tests) and the
# fast tests of its own file; the slow training tests (resume, whole models) are left out, as above.
ROUTERS_CORE = [
    "tests/test_routers.py::test_registered_routers_outputs_are_unchanged",
    "tests/test_routers.py::test_registry_has_every_router_of_the_papers",
    "tests/test_routers.py::test_softmax_token_choice_noise_and_losses",
    "tests/test_routers.py::test_softmax_token_choice_noise_has_std_noise_std_over_e",
    "tests/test_routers.py::test_sinkhorn_routers_softmax_combine_switch",
    "tests/test_routers.py::test_sinkhorn_token_choice_balances_better_than_softmax",
    "tests/test_routers.py::test_svmoe_uses_quadratic_plan_with_gamma_one_over_k",
    "tests/test_routers.py::test_expert_choice_capacity_factor",
    "tests/test_routers.py::test_soft_moe_normalisation_and_scale",
    "tests/test_routers.py::test_soft_moe_ablations_of_paper_002_table_2",
    "tests/test_routers.py::test_bad_router_arguments",
    "tests/test_routers.py::test_registered_routers_are_named_compositions",
    "tests/test_routers.py::test_per_image_is_decided_by_the_allocation_alone",
]
SUITE.update({
    "routers/affinities": ROUTERS_CORE + ["tests/test_raw_key.py::test_every_path_and_mode_routes_by_the_raw_patch",
                                          # the base class's facts (routers/affinities:40:21, :41:21 survived without it)
                                          "tests/test_mutant_killers.py::test_the_affinities_facts_follow_their_scores",
                                          # NoisySoftmax's default noise (routers/affinities:94:54)
                                          "tests/test_mutant_killers.py::test_v_moes_default_noise_has_standard_deviation_one_over_e"],
    "routers/allocations": ROUTERS_CORE + [
        "tests/test_top_p.py::test_with_tight_buffers_the_picks_follow_algorithm_1",
        "tests/test_null_experts.py::test_token_choice_with_null_experts_equals_loops",
        "tests/test_null_experts.py::test_null_picks_take_no_slot_and_are_never_dropped",
        "tests/test_mutant_killers.py::test_token_choice_makes_no_pick_whose_score_equals_min_score",  # routers/allocations:128:75
        "tests/test_mutant_killers.py::test_the_dropless_bound_on_picks_is_the_bound_per_token_times_the_tokens",  # routers/allocations:94:62
        "tests/test_mutant_killers.py::test_allocations_are_immutable_values",  # routers/allocations:170:30
    ],
    "routers/balancing": ROUTERS_CORE + [
        "tests/test_loss_free.py::test_bad_options_name_the_argument",
        "tests/test_loss_free.py::test_group_limited_routing_equals_deepseek_v3s_gate_whatever_the_level_of_the_bias",
        "tests/test_loss_free.py::test_the_routers_sequence_balance_counts_the_unbiased_top_k",
        "tests/test_loss_free.py::test_gates_are_normalised_unbiased_sigmoid_scores_of_the_biased_top_k",
        "tests/test_loss_free.py::test_bias_update_runs_under_jit_and_grad",
        "tests/test_loss_free.py::test_sequence_balance_loss_by_hand",
        "tests/test_loss_free.py::test_bias_moves_overloaded_experts_down_and_only_in_training",
        "tests/test_loss_free.py::test_the_batch_wise_balance_loss_counts_every_token_of_the_batch",
        "tests/test_loss_free.py::test_at_k1_the_gate_is_the_chosen_score_and_the_router_learns_from_the_task",
        "tests/test_loss_free.py::test_global_batch_balance_counts_the_whole_batch",
        # ReMoE's ReluGates live here too (added after the first 11 mutants of issue 66's run:
        # routers/balancing:248:65 survived the list above and dies to the penalty test)
        "tests/test_remoe.py::test_bad_options",
        "tests/test_remoe.py::test_threshold_token_choice_equals_the_loop",
        "tests/test_remoe.py::test_penalty_is_load_balanced_l1_times_lambda",
        "tests/test_remoe.py::test_controller_moves_lambda_towards_the_target_sparsity",
        "tests/test_remoe.py::test_gates_are_relu_and_the_combine_weights",
        # the bias under gradient accumulation (routers/balancing:108:11 survived without it)
        "tests/test_grad_accum.py::test_the_bias_moves_once_per_step_not_once_per_micro_batch",
        # ReMoE's model-level controller in eval mode (routers/balancing:265:85 survived without it)
        "tests/test_mutant_killers.py::test_remoes_model_lambda_moves_only_in_training_mode",
        # routers/balancing:268:11, :253:17, :145:92
        "tests/test_mutant_killers.py::test_remoes_model_lambda_moves_by_the_mean_sparsity_of_its_layers",
        "tests/test_mutant_killers.py::test_remoes_probabilities_are_the_gates_normalised_per_token",
        "tests/test_mutant_killers.py::test_the_loss_free_bias_spread_is_the_range_of_the_bias",
    ],
    "routers/adaptive": ROUTERS_CORE + [
        "tests/test_top_p.py::test_bad_options_name_the_argument",
        "tests/test_top_p.py::test_selection_equals_the_papers_rule",
        "tests/test_top_p.py::test_the_router_dispatches_exactly_the_selection_with_the_probabilities_as_weights",
        "tests/test_top_p.py::test_a_cumulative_that_reaches_p_exactly_stops_the_selection",
        "tests/test_top_p.py::test_the_threshold_moves_once_per_accumulated_step_and_never_without_a_target",
        "tests/test_top_p.py::test_a_tiny_threshold_is_top_1_and_the_selection_grows_with_p",
        "tests/test_top_p.py::test_the_controller_holds_the_target_number_of_experts_per_token",
        "tests/test_top_p.py::test_the_dynamic_loss_is_the_mean_entropy_and_the_balance_counts_the_selection",
        "tests/test_top_p.py::test_p_1_under_round_off_selects_every_expert_and_never_a_zero_probability",
        "tests/test_remoe.py::test_bad_options",
        "tests/test_remoe.py::test_threshold_token_choice_equals_the_loop",
        "tests/test_remoe.py::test_penalty_is_load_balanced_l1_times_lambda",
        "tests/test_remoe.py::test_controller_moves_lambda_towards_the_target_sparsity",
        "tests/test_remoe.py::test_gates_are_relu_and_the_combine_weights",
        "tests/test_mutant_killers.py::test_top_p_defaults_to_the_reference_codes_threshold",  # routers/adaptive:147:54
    ],
    "routers/null": ROUTERS_CORE + [
        "tests/test_null_experts.py::test_bad_input_names_the_argument",
        "tests/test_null_experts.py::test_token_choice_with_null_experts_equals_loops",
        "tests/test_null_experts.py::test_null_aware_loss_pools_the_null_experts",
        "tests/test_null_experts.py::test_the_controller_reaches_its_target_count",
        "tests/test_null_experts.py::test_combine_weights_keep_their_invariants",
        "tests/test_null_experts.py::test_a_zero_expert_costs_no_flops",
        "tests/test_null_experts.py::test_null_picks_take_no_slot_and_are_never_dropped",
        "tests/test_null_experts.py::test_identity_expert_is_the_identity_and_constant_expert_is_moe_plus_plus",
        # killers of this run's survivors (routers/null:136:62, :117:11)
        "tests/test_mutant_killers.py::test_only_the_null_aware_balance_adds_an_auxiliary_loss",
        "tests/test_mutant_killers.py::test_longcats_controller_steps_under_gradient_accumulation_and_adamoes_bias_never_moves",
        "tests/test_mutant_killers.py::test_the_null_expert_routers_keep_the_null_picks_weights_by_default",  # routers/null:159:46
        "tests/test_mutant_killers.py::test_the_registered_routers_route_in_training_mode_in_group_order_by_default",  # routers/null:159:27
    ],
    "routers/controls": ROUTERS_CORE + [
        "tests/test_routing_controls.py::test_expert_choice_with_token_choices_noise",
        "tests/test_routing_controls.py::test_a_frozen_router_keeps_its_initial_weights_while_the_experts_train",
        "tests/test_routing_controls.py::test_study_variants_set_exactly_their_options",
        "tests/test_routing_controls.py::test_token_choice_without_noise_and_loss_changes_exactly_those",
        "tests/test_routing_controls.py::test_the_hash_router_is_balanced_on_random_tokens_deterministic_and_learns_nothing",
        # the BLIND key's default bin width (routers/controls:156:111 survived without it)
        "tests/test_mutant_killers.py::test_the_blind_keys_bins_are_half_a_standard_deviation_wide",
        "tests/test_mutant_killers.py::test_the_blind_key_is_a_murmur_finalised_hash_of_the_bins",  # routers/controls:186:23
    ],
    "routers/papers": ROUTERS_CORE + [
        "tests/test_mutant_killers.py::test_the_registered_routers_route_in_training_mode_in_group_order_by_default",  # :47:81, :48:100
        "tests/test_mutant_killers.py::test_a_routers_solver_settings_default_to_its_affinitys",  # :173:85
    ],
    "routers/stateful": ROUTERS_CORE + [
        "tests/test_router_protocol.py::test_the_librarys_stateful_affinities_follow_the_protocol_and_the_others_do_not",
        "tests/test_router_protocol.py::test_stateless_affinities_are_left_alone",
        "tests/test_top_p.py::test_the_threshold_moves_once_per_accumulated_step_and_never_without_a_target",
    ],
    "routers/registry": ROUTERS_CORE + ["tests/test_routers.py::test_register_refuses_a_taken_name_unless_replace",
                                        "tests/test_router_protocol.py",
                                        # RouterSpec.capacity_options (routers/registry:148:11 survived without it)
                                        "tests/test_routing.py::test_every_place_that_sizes_slots_uses_routing_capacity",
                                        # the null-expert metrics (routers/registry:84:54 survived without it)
                                        "tests/test_mutant_killers.py::test_the_real_and_null_picks_per_token_count_the_picks_by_column",
                                        "tests/test_mutant_killers.py::test_a_routers_options_are_its_keyword_options_only",  # :136:59
                                        "tests/test_mutant_killers.py::test_a_router_from_the_registry_learns_unless_asked_to_stay_frozen"],  # :195:89
    "inference": [
        "tests/test_inference.py",
        "tests/test_mutant_killers.py::test_serving_difference_counts_the_changed_predictions",  # inference:373:48
    ],
    "upcycle": ["tests/test_upcycle.py",
                "tests/test_mutant_killers.py::test_renormalised_combine_weights_have_finite_gradients_for_a_dropped_token"],  # upcycle:119:49
})
# Run on a mutant that survives SUITE: the tests issue 52 §3 added to kill the survivors.
NEW_TESTS = ["tests/test_mutant_killers.py"]
#: The modules NEW_TESTS was written for; a survivor of another module is recorded as surviving the
#: suite, without the 85 s of running NEW_TESTS that hold nothing for it (issue 66 §3's modules).
NEW_TESTS_FOR = ("routing", "layer", "losses")
# One-core XLA flags: one host device, and CI's cheaper compilation (the subsets compile far more
# than they compute, and these flags halve their time; tests/ passes under them in CI).
XLA_FLAGS = ("--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
             "--xla_cpu_use_fusion_emitters=false")

# Survivors that no input can tell from the original, with the reason (filled in by hand after a
# run; see mini_moe/results/mutants-report.md). Everything else that survives is "survived".
EQUIVALENT: dict[str, str] = {
    "upcycle:106:88:const": "Drop-Upcycling's unit permutations drawn from keys split off keys[1] instead of keys[0], "
                            "while the w1 noise is drawn from keys[1] itself: threefry's split children are "
                            "independent of their parent's own draws, so the result has the same distribution; only "
                            "which units a given key picks changes, and no specification fixes that.",
    "routing:213:86:binop": "BPR's map back to token indices reads order[min(slot, T + 1)] instead of "
                            "order[min(slot, T - 1)]: the same for every filled slot (slot < T); an empty slot "
                            "(slot == T) reads a clamped out-of-range index whose value the enclosing where "
                            "replaces by T, as for routing:213:99.",
    "layer:280:17:const": "default_block's floor max(5, ...) instead of max(4, ...): the largest power of two at "
                          "most 5 is 4, as at most 4.",
    "layer:280:24:const": "default_block takes the largest power of two at most min(65, 0.4 M / G) instead of "
                          "min(64, ...): 64 either way, since no power of two lies in (64, 65].",
    "routing:213:99:const": "BPR's map back to token indices reads order[min(slot, T)] instead of "
                            "order[min(slot, T - 1)] only for empty slots (slot == T), whose value the enclosing "
                            "where replaces by T; JAX clamps the out-of-range gather, and integer indices carry no "
                            "gradient.",
    "layer:199:80:const": "_block_layout clamps a row's group to G instead of G - 1 only for rows past the last "
                          "group's end (searchsorted gives G there); those rows' dest is the out-of-range "
                          "num_blocks * block whatever their group, and the gathers by group clamp the index to "
                          "G - 1 anyway.",
    "layer:160:59:const": "moe_sorted feeds 1 instead of 0 into the rows of picks not made; those rows lie outside "
                          "every group (the kernel need not compute them) and are selected away on the way out "
                          "(where(chosen, rows, 0)), and a select sends no gradient to what it drops.",
    "layer:147:83:const": "equivalent by redundancy: moe_sorted's gate of a pick not made is 1 instead of 0, but "
                          "it multiplies a row already selected to 0 (where(chosen, rows, 0) * gate), and the "
                          "gradient to the gate goes through that select, so `jnp.where(made, gates, 0)` is a line "
                          "no output depends on (the code review of 2026-11-28, §4.2).",
    "layer:249:88:kwstr": "_blocked_bwd writes the row gradients with mode='clip' instead of 'drop': only rows past "
                          "the last group's end have the out-of-range dest, and they exist only when M > ends[-1]; "
                          "then num_blocks * block - padded_ends[-1] >= (M - ends[-1]) + (G - 1) >= 1, so the "
                          "clipped index (the very last row) is never a real row, and its gradient multiplies "
                          "zero-padded inputs.",
    "routing:421:57:compare": "max_violation divides by where(mean >= 0, mean, 1) instead of where(mean > 0, ...): "
                              "it differs only at mean == 0, where the outer where(mean > 0, ..., 0) returns 0 "
                              "either way; MaxVio is a logged metric, never differentiated.",
    "inference:207:102:const": "capacity_sweep's default batch of 401 images instead of 400: every evaluation "
                               "batch is rounded down to whole routing groups (evaluate._padded_chunks), and 401 is "
                               "prime, so for any group size but 1 and 401 the batches are the same; with groups "
                               "of one image the batches hold whole groups either way. A test of the sweep's "
                               "accuracy past the first batch passes on both (tried).",
    "routers/balancing:121:30:const": "_limit_groups' shortcut for one group (num_groups == 0 instead of == 1 "
                                      "never takes it): routing.group_limit with one group and top_groups = 1 "
                                      "keeps every expert, so the scores are the same; only the shortcut's saved "
                                      "work is lost.",
    "routers/balancing:256:55:nostopgrad": "ReMoE's penalty lambda * P without stop_gradient on lambda: lambda is "
                                           "an L1Weight, not an nnx.Param, and every gradient the library takes "
                                           "is with respect to the Params (train.train_step, nnx.Optimizer(wrt="
                                           "nnx.Param)), so no gradient reaches it either way.",
    "routers/balancing:135:38:compare": "the loss-free bias steps when bias_rate >= 0 instead of > 0: at bias_rate "
                                        "== 0 the step adds 0 * sign(...) = +-0.0 to each bias, which leaves every "
                                        "value as it was (the bias is a state, never differentiated).",
    "losses:150:36:nostopgrad": "the null-aware Switch loss without stop_gradient on f: f is a one-hot of integer "
                                "top-k indices, averaged and pooled linearly, so it carries no gradient anyway.",
    "inference:50:63:const": "_router_probs' default batch of 401 images instead of 400: as for capacity_sweep "
                             "(inference:207:102), evaluate.forward_batches rounds each batch down to whole routing "
                             "groups, so the groups are the same for any group size but 1 and 401, and a patch's "
                             "distribution over the experts is its own softmax whatever the batch (with groups of one "
                             "image, only the batch shapes differ, which moves no value beyond float32 rounding).",
    "layer:401:54:const": "lecun_normal(in_axis=-1, out_axis=-1, batch_axis=(0,)) on [E, D, H]: Flax's fan-in is "
                          "the in-axis size times the receptive field, size / (in x out x batch), so it is "
                          "size / (out x batch) = D whichever non-batch axis is named in_axis: the same draws.",
}
# Survivors that are not equivalent but that no test on a CPU can tell apart, with the reason: they
# change what a TPU does (speed, memory), never a value (the code review of 2026-11-28, §4.2, which
# also found two "equivalent" performance mutants of the blocked kernel, layer:210:28 and
# layer:256:31, that compute the product of an unused block: tests/test_mutant_killers.py counts the
# blocks computed and kills them).
UNTESTABLE: dict[str, str] = {
    "layer:316:14:call": "untestable on a CPU, not equivalent: megablox's row tile max(128, M) instead of "
                         "min(128, M) gives the same product under Pallas' interpreter (the only place CI runs "
                         "the kernel), but on a TPU a tile of all M rows must fit the vector memory, which at "
                         "the book's shapes it would not (not run: no TPU).",
    "layer:316:27:call": "untestable on a CPU, not equivalent: megablox's contraction tile max(128, K) instead of "
                         "min(128, K), as for the row tile (not run: no TPU).",
}
# Notes on the survivors that are not equivalent (why no test kills them yet).
SURVIVOR_NOTES: dict[str, str] = {}

SWAP_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
              ast.FloorDiv: ast.Mult, ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv,
              ast.BitOr: ast.BitAnd, ast.BitAnd: ast.BitOr, ast.LShift: ast.RShift}
SWAP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
SWAP_CALL = {"max": "min", "min": "max", "argmax": "argmin", "argmin": "argmax", "maximum": "minimum",
             "minimum": "maximum", "sum": "mean", "mean": "sum", "any": "all", "all": "any",
             "zeros": "ones", "ones": "zeros", "zeros_like": "ones_like", "ones_like": "zeros_like",
             "floor": "ceil", "ceil": "floor"}
SWAP_KWSTR = {("mode", "drop"): "clip", ("mode", "clip"): "drop", ("side", "right"): "left",
              ("side", "left"): "right"}


class Mutant(dict):
    """id, module, line, col, end_line, end_col, operator, replacement (source text)."""


def _segment(lines, node):
    """The source text of a node (possibly several lines)."""
    if node.lineno == node.end_lineno:
        return lines[node.lineno - 1][node.col_offset:node.end_col_offset]
    parts = [lines[node.lineno - 1][node.col_offset:]]
    parts += lines[node.lineno:node.end_lineno - 1]
    parts.append(lines[node.end_lineno - 1][:node.end_col_offset])
    return "\n".join(parts)


def _skipped_nodes(tree):
    """Ids of nodes that are never mutated: docstrings, raise statements, f-strings, annotations,
    imports, and the ``if`` tests whose body only raises (input checks)."""
    skip = set()

    def mark(node):
        for sub in ast.walk(node):
            skip.add(id(sub))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                mark(body[0])
        if isinstance(node, (ast.Raise, ast.JoinedStr, ast.Import, ast.ImportFrom)):
            mark(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.returns is not None:
                mark(node.returns)
            for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                if a.annotation is not None:
                    mark(a.annotation)
        if isinstance(node, ast.AnnAssign):
            mark(node.annotation)
        if isinstance(node, ast.If) and all(isinstance(s, ast.Raise) for s in node.body) and not node.orelse:
            mark(node.test)  # an input check: the tests of mini_moe.validate's messages cover these
    return skip


def _unparse(node):
    return ast.unparse(node)


def generate(module: str, source: str) -> list[Mutant]:
    """Every first-order mutant of one module, sorted by id (deduplicated on the mutated text)."""
    tree = ast.parse(source)
    lines = source.split("\n")
    skip = _skipped_nodes(tree)
    axis_values = set()  # constants with an operator of their own (axis=), or shape plumbing
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "axis":
            for sub in ast.walk(node.value):
                axis_values.add(id(sub))
        if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
            axis_values.add(id(node.operand))  # a negative literal is perturbed as a whole
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
            for sub in ast.walk(node.slice):
                skip.add(id(sub))  # x.shape[-1]: another index fails on a shape, not on a value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "reshape":
            for arg in node.args:
                for sub in ast.walk(arg):
                    if isinstance(sub, (ast.Constant, ast.UnaryOp)):
                        skip.add(id(sub))  # reshape(-1, ...): the same
    out = []

    def add(node, operator, replacement, paren=True):
        text = f"({replacement})" if paren else replacement
        if text == _segment(lines, node) or replacement == _segment(lines, node):
            return
        out.append(Mutant(module=module, line=node.lineno, col=node.col_offset, end_line=node.end_lineno,
                          end_col=node.end_col_offset, operator=operator, replacement=text,
                          id=f"{module}:{node.lineno}:{node.col_offset}:{operator}"))

    def copy(node):
        return ast.parse(_segment(lines, node).strip() if node.lineno == node.end_lineno
                         else _unparse(node), mode="eval").body

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.BinOp) and type(node.op) in SWAP_BINOP:
            new = ast.BinOp(left=node.left, op=SWAP_BINOP[type(node.op)](), right=node.right)
            add(node, "binop", _unparse(new))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAP_CMP:
            new = ast.Compare(left=node.left, ops=[SWAP_CMP[type(node.ops[0])]()], comparators=node.comparators)
            add(node, "compare", _unparse(new))
        elif isinstance(node, ast.BoolOp):
            new = ast.BoolOp(op=ast.Or() if isinstance(node.op, ast.And) else ast.And(), values=node.values)
            add(node, "boolop", _unparse(new))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)) \
                and id(node) not in axis_values and id(node) not in skip:
            if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
                pass  # a negative literal: the const operator below perturbs it
            else:
                add(node, "unary", _unparse(node.operand))
            if isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                    and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
                v = -node.operand.value
                add(node, "const", repr(v + 1 if isinstance(v, int) else v * 2))
        elif isinstance(node, ast.Constant) and id(node) not in axis_values:
            v = node.value
            if isinstance(v, bool):
                add(node, "const", repr(not v), paren=False)
            elif isinstance(v, int):
                add(node, "const", repr(1 if v == 0 else 0 if v == 1 else v + 1), paren=False)
            elif isinstance(v, float):
                add(node, "const", repr(1.0 if v == 0 else v * 2), paren=False)
        elif isinstance(node, ast.keyword) and node.arg == "axis" and id(node) not in skip:
            val = node.value
            try:
                a = ast.literal_eval(val)
            except ValueError:
                a = None
            if isinstance(a, int):
                b = a + 1 if a < -1 else a - 1 if a != 0 else 1
                add(val, "axis", repr(b), paren=False)
        elif isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant) \
                and (node.arg, node.value.value) in SWAP_KWSTR:
            add(node.value, "kwstr", repr(SWAP_KWSTR[(node.arg, node.value.value)]), paren=False)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else None
            if name == "stop_gradient" and len(node.args) == 1:
                add(node, "nostopgrad", _unparse(node.args[0]))
            elif name == "where" and len(node.args) == 3:
                new = ast.Call(func=func, args=[node.args[0], node.args[2], node.args[1]], keywords=node.keywords)
                add(node, "where", _unparse(new))
            elif name in SWAP_CALL or (isinstance(func, ast.Name) and func.id in ("max", "min")):
                if isinstance(func, ast.Attribute):
                    new = ast.Call(func=ast.Attribute(value=func.value, attr=SWAP_CALL[name], ctx=ast.Load()),
                                   args=node.args, keywords=node.keywords)
                else:
                    new = ast.Call(func=ast.Name(id=SWAP_CALL[func.id], ctx=ast.Load()), args=node.args,
                                   keywords=node.keywords)
                add(node, "call", _unparse(new))
        elif isinstance(node, ast.If):
            add(node.test, "ifnot", f"not ({_unparse(node.test)})")
        elif isinstance(node, ast.Slice):
            if node.upper is not None:
                add(node.upper, "slice", f"{_unparse(node.upper)} - 1")
            if node.lower is not None:
                add(node.lower, "slice", f"{_unparse(node.lower)} + 1")
    # one mutant per id (two operators cannot share a node's position and name)
    seen, unique = set(), []
    for m in sorted(out, key=lambda m: (m["line"], m["col"], m["operator"], m["replacement"])):
        mid = m["id"]
        n = 2
        while mid in seen:
            mid, n = f"{m['id']}#{n}", n + 1
        m["id"] = mid
        seen.add(mid)
        unique.append(m)
    return unique


def apply(source: str, m: Mutant) -> str:
    lines = source.split("\n")
    first, last = lines[m["line"] - 1], lines[m["end_line"] - 1]
    new = first[:m["col"]] + m["replacement"] + last[m["end_col"]:]
    return "\n".join(lines[:m["line"] - 1] + [new] + lines[m["end_line"]:])


def all_mutants(modules=MODULES, sample=None):
    mutants = []
    for module in modules:
        source = (ROOT / "mini_moe" / f"{module}.py").read_text()
        for m in generate(module, source):
            mutated = apply(source, m)
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            m["original_line"] = source.split("\n")[m["line"] - 1].strip()
            m["mutated_line"] = mutated.split("\n")[m["line"] - 1].strip()
            mutants.append(m)
    if sample is not None and sample < len(mutants):
        ranked = sorted(mutants, key=lambda m: hashlib.sha1(m["id"].encode()).hexdigest())[:sample]
        keep = {m["id"] for m in ranked}
        mutants = [m for m in mutants if m["id"] in keep]
    return mutants


# ----------------------------------------------------------------------------- running


def env_one_core():
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=XLA_FLAGS,
               PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    return env


def prepare_work(work: Path):
    """A throw-away copy of the repository's tracked Python sources (tests, package, data)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for sub in ("mini_moe", "tests"):
        shutil.copytree(ROOT / sub, work / sub, ignore=shutil.ignore_patterns("__pycache__", "results"))
    (work / "mini_moe" / "results").mkdir(exist_ok=True)
    for f in ("pyproject.toml", "conftest.py"):
        if (ROOT / f).exists():
            shutil.copy2(ROOT / f, work / f)


def pytest_cmd(work: Path, tests, core: str):
    return ["taskset", "-c", core, str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", *tests,
            "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", "--rootdir", str(work),
            "-W", "ignore::DeprecationWarning", "--tb=line", "-o", "addopts="]


def run_tests(work: Path, module: str, tests, core: str, timeout: float):
    env = env_one_core()
    env["PYTHONPATH"] = str(work)
    env["MUTANTS_EXPECT"] = str(work / "mini_moe" / f"{module}.py")
    start = time.monotonic()
    try:
        proc = subprocess.run(pytest_cmd(work, tests, core), cwd=work, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", None, time.monotonic() - start, ""
    elapsed = time.monotonic() - start
    text = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "survived", None, elapsed, text
    failed = None
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            failed = line.split(" ", 1)[1].split(" - ")[0].strip()
            break
    outcome = "error" if proc.returncode in (2, 3, 4) or "ImportError" in text and failed is None else "killed"
    return outcome, failed, elapsed, text[-2000:]


def check_import(work: Path, module: str, core: str):
    """The copy's module is the one imported (not /work/main's)."""
    env = env_one_core()
    env["PYTHONPATH"] = str(work)
    code = f"import mini_moe.{module.replace('/', '.')} as m; print(m.__file__)"
    out = subprocess.run(["taskset", "-c", core, str(ROOT / ".venv" / "bin" / "python"), "-c", code], cwd=work,
                         env=env, capture_output=True, text=True).stdout.strip()
    expected = str(work / "mini_moe" / f"{module}.py")
    if out != expected:
        sys.exit(f"the copy's module is not the one imported: {out!r} != {expected!r}")


def load_done(path: Path):
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    return done


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--module", action="append", choices=MODULES, help="only this module (repeatable)")
    p.add_argument("--limit", type=int, help="run at most this many mutants (after --resume's skipping)")
    p.add_argument("--sample", type=int, help="cut the set to N mutants by sha1(id) rank (deterministic)")
    p.add_argument("--only", action="append", help="run only this mutant id (repeatable)")
    p.add_argument("--resume", action="store_true", help="skip the ids already in --results (the default)")
    p.add_argument("--rerun", action="store_true", help="run the selected mutants again even if done")
    p.add_argument("--list", action="store_true", help="print the mutants and exit")
    p.add_argument("--report", action="store_true", help="write the JSON report from --results")
    p.add_argument("--work", default="/tmp/mutants-work", help="the throw-away copy")
    p.add_argument("--results", default="/tmp/mutants-results.jsonl",
                   help="the JSONL of finished mutants (outside the work copy, which each run rebuilds)")
    p.add_argument("--out", default=str(RESULTS / "mutants-cpu-2core-epyc.json"))
    p.add_argument("--core", default="1", help="the CPU core for taskset (one core only)")
    p.add_argument("--timeout-factor", type=float, default=3.0)
    args = p.parse_args(argv)
    modules = tuple(args.module) if args.module else MODULES
    mutants = all_mutants(modules, args.sample)
    if args.only:
        mutants = [m for m in mutants if m["id"] in set(args.only)]
    if args.list:
        for m in mutants:
            print(m["id"], "|", m["original_line"], "=>", m["mutated_line"])
        print(len(mutants), "mutants", {mod: sum(m["module"] == mod for m in mutants) for mod in modules})
        return
    results = Path(args.results)
    if args.report:
        return write_report(mutants, results, Path(args.out), args)
    done = {} if args.rerun else load_done(results)
    # in sha1(id) order, so that the mutants done after any interruption are themselves the
    # deterministic sample of that size (the N smallest sha1 digests)
    todo = sorted((m for m in mutants if m["id"] not in done), key=lambda m: hashlib.sha1(m["id"].encode()).hexdigest())
    if args.limit is not None:
        todo = todo[:args.limit]
    work = Path(args.work)
    source = {"source_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                              text=True).stdout.strip(),
              "source_dirty": bool(subprocess.run(["git", "status", "--porcelain", "--", "mini_moe", "tests", ":!mini_moe/results"], cwd=ROOT,
                                                  capture_output=True, text=True).stdout.strip())}
    prepare_work(work)
    sources = {mod: (work / "mini_moe" / f"{mod}.py").read_text() for mod in modules}
    # Each distinct test list is timed once, and the times are kept beside --results for a resumed
    # run of the same sources (a restart would otherwise spend 15 minutes timing them again).
    digest = hashlib.sha1("".join(sources[m] for m in modules).encode()).hexdigest()  # times are keyed by list
    cache = results.with_suffix(".baselines.json")
    timed = {}
    if cache.exists() and json.loads(cache.read_text()).get("sources") == digest:
        timed = {tuple(json.loads(k)): v for k, v in json.loads(cache.read_text())["seconds"].items()}
    baseline = {}
    for mod in modules:
        check_import(work, mod, args.core)
        for name, tests in (("suite", SUITE[mod]), ("new", NEW_TESTS)):
            if name == "new" and mod not in NEW_TESTS_FOR:
                continue
            if tuple(tests) not in timed:
                outcome, failed, elapsed, text = run_tests(work, mod, tests, args.core, timeout=1800)
                if outcome != "survived":
                    sys.exit(f"the unmutated copy fails the {mod} {name} subset ({outcome}, {failed}):\n{text[-3000:]}")
                timed[tuple(tests)] = elapsed
                print(f"baseline {mod} {name}: {elapsed:.1f} s, passes", flush=True)
                results.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps({"sources": digest, "seconds": {json.dumps(list(k)): v
                                                                             for k, v in timed.items()}}))
            baseline[mod, name] = timed[tuple(tests)]
    results.parent.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(todo):
        mod = m["module"]
        target = work / "mini_moe" / f"{mod}.py"
        target.write_text(apply(sources[mod], m))
        record = {k: m[k] for k in ("id", "module", "line", "col", "operator", "original_line", "mutated_line")}
        record.update(source)  # the commit the work copy was made from (the report names it)
        try:
            outcome, failed, elapsed, text = run_tests(work, mod, SUITE[mod], args.core,
                                                       timeout=args.timeout_factor * baseline[mod, "suite"])
            record.update(outcome=outcome, killed_by=failed, seconds=round(elapsed, 1),
                          baseline_seconds=round(baseline[mod, "suite"], 1))
            if outcome == "error":
                record["detail"] = text[-400:]
            if outcome == "survived" and mod in NEW_TESTS_FOR:  # the tests added for issue 52 §3
                new, new_failed, new_elapsed, _ = run_tests(work, mod, NEW_TESTS, args.core,
                                                            timeout=args.timeout_factor * baseline[mod, "new"])
                record.update(outcome_with_new_tests=new, killed_by_new_test=new_failed,
                              seconds_new=round(new_elapsed, 1))
        finally:
            target.write_text(sources[mod])
        with results.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"[{i + 1}/{len(todo)}] {m['id']} {outcome} {failed or ''} {record.get('outcome_with_new_tests', '')} "
              f"{record.get('killed_by_new_test') or ''} {elapsed:.1f}s", flush=True)


def write_report(mutants, results: Path, out: Path, args):
    done = load_done(results)
    rows, totals = [], {}
    dead_outcomes = ("killed", "timeout", "error")
    for m in mutants:
        r = done.get(m["id"])
        if r is None:
            continue
        row = dict(r)
        if r["outcome"] == "survived":
            if r.get("outcome_with_new_tests") in dead_outcomes:
                row["classification"] = "killed-by-new-test"
            elif m["id"] in EQUIVALENT:
                row["classification"], row["reason"] = "equivalent", EQUIVALENT[m["id"]]
            elif m["id"] in UNTESTABLE:
                row["classification"], row["reason"] = "untestable", UNTESTABLE[m["id"]]
            else:
                row["classification"] = "survived"
                row["reason"] = SURVIVOR_NOTES.get(m["id"])
        rows.append(row)
        t = totals.setdefault(m["module"], {k: 0 for k in (
            "mutants", "killed", "timeout", "error", "survived_suite", "killed_by_new_test", "equivalent",
            "untestable", "survived")})
        t["mutants"] += 1
        if r["outcome"] in dead_outcomes:
            t[r["outcome"]] += 1
        else:
            t["survived_suite"] += 1
            t[row["classification"].replace("-", "_")] += 1
    def rates(t):  # over the mutants a CPU test could kill: neither equivalent nor untestable here
        non_eq = t["mutants"] - t["equivalent"] - t["untestable"]
        dead = t["killed"] + t["timeout"] + t["error"]
        t["non_equivalent"] = non_eq
        t["kill_rate_suite"] = round(dead / non_eq, 4) if non_eq else None
        t["kill_rate_with_new_tests"] = round((dead + t["killed_by_new_test"]) / non_eq, 4) if non_eq else None
        return t
    for t in totals.values():
        rates(t)
    keys = ("mutants", "killed", "timeout", "error", "survived_suite", "killed_by_new_test", "equivalent", "untestable",
            "survived")
    all_t = rates({k: sum(t[k] for t in totals.values()) for k in keys})
    report = {
        "what": f"{_issue(totals)}: mutation testing of mini_moe/"
                f"{', '.join(m + '.py' for m in sorted(totals))} with .ci/mutants.py "
                "(first-order ast mutants, each run against a fast subset of the existing tests in a throw-away "
                "copy, then, if it survives, against tests/test_mutant_killers.py; killed = a test fails, "
                "timeout = past 3x the unmutated run, error = the subset cannot run, e.g. the module does not "
                "import). Kill rates are over the mutants neither equivalent nor untestable on a CPU.",
        "command": "make mutants MUTANTS_ARGS='" + " ".join(
            ([f"--sample {args.sample}"] if args.sample else []) + [f"--results {_rel(results)}", f"--out {_rel(out)}"]) + "'",
        "results": _rel(results),
        "machine": {"cpu": "AMD EPYC", "cores": 2, "cores_used": 1, "gpu": None, "platform": platform.platform(),
                    "python": platform.python_version(), "taskset": "-c 1", "XLA_FLAGS": XLA_FLAGS,
                    "JAX_PLATFORMS": "cpu"},
        "source_commits": sorted({(r.get("source_commit"), r.get("source_dirty")) for r in rows}, key=str),
        "generated": {mod: sum(1 for m in all_mutants((mod,))) for mod in MODULES},
        "sampling": "none: every generated mutant" if args.sample is None else
                    f"the {args.sample} mutants (of all modules together) with the smallest sha1(id) hex digest",
        "suite_tests": SUITE,
        "new_tests": NEW_TESTS,
        "totals": {"all": all_t, **totals},
        "mutants": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_name(out.name.replace("-cpu-2core-epyc.json", "-report.md")).write_text(markdown(report, out.name))
    print(json.dumps(report["totals"], indent=1))


def _rel(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _issue(totals) -> str:
    """Which issue's run a report is: issue 52 §3 mutated routing, layer and losses only."""
    return "issue 52 §3" if set(totals) - {"all"} <= {"routing", "layer", "losses"} else "issue 66 §3"


def markdown(report, json_name="mutants-cpu-2core-epyc.json"):
    """The short report: totals per module, the survivors, the command and the machine."""
    t = report["totals"]
    issue = _issue(t)
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    history = ("- A run goes in sha1(id) order and is resumable (a 'run' below the sample is a partial run). The "
               "committed one (2026-11-27/28) ran all 160; the survivors of its first pass were run again "
               "(`--only ID --rerun`) once their tests existed, and the megablox test joined the layer suite then "
               "(the only test of the TPU kernel's branch, under Pallas' interpreter). A mutant's record is its "
               "last run." if issue == "issue 52 §3" else
               "- A run goes in sha1(id) order and is resumable. Issue 66's run (2026-11-29, over sessions; each "
               "record names the commit its copy was made from, `source_commits` above) sampled 240 of the "
               "modules' mutants; a survivor of its first pass was run again (`--only ID --rerun`) once a test "
               "for it existed or its module's subset had gained an existing test that kills it. A mutant's "
               "record is its last run.")
    lines = [
        f"# Mutation testing ({issue})", "",
        "Generated by `.ci/mutants.py --report` from the run's JSONL; the per-mutant results are in "
        f"[`{json_name}`]({json_name}).", "",
        f"- Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, one used "
        f"(`taskset -c 1`), no GPU; `JAX_PLATFORMS=cpu`, `XLA_FLAGS='{report['machine']['XLA_FLAGS']}'`.",
        f"- Reproduce: `{report['command']}` (resumable: it skips the ids already in "
        f"`{report.get('results', '/tmp/mutants-results.jsonl')}`; delete that file to start over).",
        f"- Mutants generated: {report['generated']} ({sum(report['generated'].values())}); "
        f"sampling: {report['sampling']}; run: {t['all']['mutants']}.",
        history,
        "- A mutant is run against a fast subset of the existing tests (`SUITE` in the script); if it "
        "survives, against `tests/test_mutant_killers.py`, the tests added for the survivors.", "",
        "| module | mutants | killed by the suite (incl. timeout/error) | survived the suite | killed by a new test "
        "| equivalent | untestable on a CPU | still surviving | kill rate, suite | kill rate, with the new tests |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mod in [m for m in MODULES if m in t] + ["all"]:
        if mod not in t:
            continue
        x = t[mod]
        lines.append(f"| {mod} | {x['mutants']} | {x['killed'] + x['timeout'] + x['error']} "
                     f"({x['timeout']} timeout, {x['error']} error) | {x['survived_suite']} | "
                     f"{x['killed_by_new_test']} | {x['equivalent']} | {x['untestable']} | {x['survived']} | "
                     f"{pct(x['kill_rate_suite'])} | "
                     f"{pct(x['kill_rate_with_new_tests'])} |")
    lines += ["", "Kill rates are over the mutants a CPU test could kill (mutants minus equivalent minus untestable).", ""]
    for title, cls in (("Equivalent mutants", "equivalent"), ("Untestable on a CPU", "untestable"), ("Survivors", "survived"),
                       ("Killed only by the new tests", "killed-by-new-test")):
        rows = [r for r in report["mutants"] if r.get("classification") == cls]
        lines += [f"## {title} ({len(rows)})", ""]
        for r in rows:
            why = r.get("reason") or (f"killed by `{r['killed_by_new_test'].split('::')[-1]}`"
                                      if cls == "killed-by-new-test" else "")
            lines.append(f"- `{r['id']}`: `{r['original_line']}` -> `{r['mutated_line']}`. {why}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
