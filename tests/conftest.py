"""Test-wide set-up: the same torch sharing strategy that p2p_diloco uses, set before hivemind is imported."""

import fcntl
import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
# One torch thread for what tests compute in pytest's own process (the peers they start get --run.num_threads 1):
# with torch's default of one thread per core, next to busy loops and the other test worker, the in-process
# trainer runs of tests/unit/test_diloco_reference.py took 70-86 s each under make test's two workers (0.6 s idle)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The longest tests (seconds under `make test`'s two workers beside two busy loops), started first: with
# `--dist worksteal` the workers then end together instead of one of them running a 90 s test alone at the end.
# A test missing here only starts later; the list is a schedule, not a selection.
LONGEST_FIRST = [
    "test_fragments.py::test_peers_of_three_splits_average_every_fragment_together",  # 113
    "test_nat.py::test_peers_behind_nat_average_every_round_and_a_newcomer_behind_it_downloads_the_state",  # 88 (root)
    "test_pipeline.py::test_killing_one_stage_stops_its_peer_cleanly",  # 77
    "test_ops.py::test_status_and_metrics_of_a_running_swarm",  # 76
    # root only (network namespaces): 75 s on a machine where test_killing_one_stage took 86 (against its 77 here)
    "test_torchrun_cluster.py::test_a_peer_across_two_nodes_averages_with_the_swarm_and_stops_whole",
    "test_byzantine.py::test_repeat_offender_is_banned_and_the_others_go_on",  # 57
    "test_swarm.py::test_swarm_stopped_with_sigterm_stops_its_peers",  # 68 (alone, idle)
    "test_churn.py::test_killed_peer_restarted_on_its_checkpoint_is_back_in_sync",  # 50
    "test_quality_bench.py::test_a_second_seed_is_added_to_an_earlier_table_without_running_the_first_again",  # 50
    "test_churn.py::test_newcomer_downloads_the_swarms_state",  # 46
    "test_status_page.py::test_the_page_of_a_small_swarm_shows_its_peers",  # 25-47 (alone, beside other work)
    "test_pipeline.py::test_mismatched_split_is_refused",  # 42
    "test_swarm.py::test_a_groupmate_killed_inside_the_all_reduce_does_not_cost_the_others_the_round",  # 40
    "test_hostile_leader.py::test_a_groupmate_that_stalls_the_all_reduce_is_named_and_banned",  # 39
    "test_swarm.py::test_killed_peer_does_not_stop_the_other",  # 37
    "test_swarm.py::test_swarm_command_summary_and_plot",  # 35
    "test_hostile_leader.py::test_a_leader_that_forges_other_members_records_gets_no_honest_peer_named_or_banned",
    "test_swarm.py::test_a_last_round_split_into_groups_still_ends_on_one_model",  # 33
    "test_pipeline.py::test_two_stages_compute_what_one_process_computes",  # 31
    "test_ops.py::test_two_bootstrap_nodes_one_killed_swarm_goes_on_and_newcomer_joins_through_the_other",  # 27
    "test_churn.py::test_sigterm_exits_cleanly_with_a_fresh_checkpoint",  # 26
    "test_byzantine.py::test_swarm_with_hostile_peers_trains_and_names_them",  # 26
    "test_fragments.py::test_streaming_sync_staggers_the_fragments_of_peers_of_two_splits",  # 26
    "test_swarm.py::test_three_peers_identical_anchors_and_runs_never_mix",  # 3 x 15-25
]


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        for index, name in enumerate(LONGEST_FIRST):
            if name in item.nodeid:
                return index
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order (integration, then unit)


# Tests that run alone even under two workers: the mixed-split test's four peers are 21 processes, and next to
# another worker's test (and CI's busy loops) a `status` call inside it took over 90 s to start and answer
ALONE = ["test_fragments.py::test_peers_of_three_splits_average_every_fragment_together"]
_locks: dict[str, object] = {}


def _lock_file(run: str, name: str):
    if name not in _locks:
        _locks[name] = open(Path(tempfile.gettempdir()) / f"p2p-diloco-tests-{run}.{name}", "a")
    return _locks[name]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist, every test holds the run's lock file shared, a test of ALONE exclusively: it waits for the
    other worker's test to end, and that worker waits for it. A gate taken on the way in keeps the other worker
    from taking the shared lock again and again while an ALONE test waits (flock does not queue). Outside
    pytest-timeout's timer (tryfirst: the outer wrapper), so waiting is not counted in a test's timeout."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing to share
        yield
        return
    gate, machine = _lock_file(run, "gate"), _lock_file(run, "lock")
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(machine, fcntl.LOCK_EX if any(name in item.nodeid for name in ALONE) else fcntl.LOCK_SH)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(machine, fcntl.LOCK_UN)
