"""Test-wide set-up: the same torch sharing strategy that p2p_diloco uses, set before hivemind is imported."""

import os

os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

# The longest tests (seconds under `make test`'s two workers beside two busy loops), started first: with
# `--dist worksteal` the workers then end together instead of one of them running a 90 s test alone at the end.
# A test missing here only starts later; the list is a schedule, not a selection.
LONGEST_FIRST = [
    "test_fragments.py::test_peers_of_three_splits_average_every_fragment_together",  # 96
    "test_churn.py::test_killed_peer_restarted_on_its_checkpoint_is_back_in_sync",  # 93
    "test_churn.py::test_newcomer_downloads_the_swarms_state",  # 91
    "test_ops.py::test_status_and_metrics_of_a_running_swarm",  # 71
    "test_swarm.py::test_killed_peer_does_not_stop_the_other",  # 52
    "test_pipeline.py::test_killing_one_stage_stops_its_peer_cleanly",  # 48
    "test_swarm.py::test_a_peer_at_half_speed_ends_every_round_with_the_others",  # 48
    "test_byzantine.py::test_repeat_offender_is_banned_and_the_others_go_on",  # 48
    "test_quality_bench.py::test_a_second_seed_is_added_to_an_earlier_table_without_running_the_first_again",  # 45
    "test_swarm.py::test_a_groupmate_killed_inside_the_all_reduce_does_not_cost_the_others_the_round",  # 43
    "test_byzantine.py::test_swarm_with_hostile_peers_trains_and_names_them",  # 40
    "test_hostile_leader.py::test_a_groupmate_that_stalls_the_all_reduce_is_named_and_banned",  # 38
    "test_swarm.py::test_swarm_command_summary_and_plot",  # 36
    "test_ops.py::test_two_bootstrap_nodes_one_killed_swarm_goes_on_and_newcomer_joins_through_the_other",  # 35
    "test_hostile_leader.py::test_a_leader_that_forges_other_members_records_gets_no_honest_peer_named_or_banned",
    "test_pipeline.py::test_mismatched_split_is_refused",  # 32
    "test_swarm.py::test_three_peers_identical_anchors_and_runs_never_mix",  # 3 x 29-31
    "test_pipeline.py::test_two_stages_compute_what_one_process_computes",  # 30
    "test_fragments.py::test_streaming_sync_staggers_the_fragments_of_peers_of_two_splits",  # 26
    "test_churn.py::test_sigterm_exits_cleanly_with_a_fresh_checkpoint",  # 26
]


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        for index, name in enumerate(LONGEST_FIRST):
            if name in item.nodeid:
                return index
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order (integration, then unit)
