"""``p2p_diloco.plan`` and ``p2p-diloco plan``: the formulas on hand-computed cases, validation, the CLI (in this
process; tests/integration/test_cli.py runs it as its own process)."""

import json
import math
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from p2p_diloco.cli.main import main
from p2p_diloco.config import ConfigError
from p2p_diloco.plan import (
    PAPER_NUM_PARAMS,
    PAPER_SPEEDUP,
    PlanInputs,
    make_plan,
    min_inner_steps_to_hide,
    paper_inputs,
    plan_as_dict,
    preset_num_params,
)
from p2p_diloco.plan_text import format_plan

GB = 1e9


def test_two_peers_send_one_contribution_per_round():
    # N=2: 2 * (2-1)/2 * params * 4 bytes = params * 4; 1e9 fp32 params = 4 GB = 32 Gbit -> 32 s at 1 Gbit/s
    plan = make_plan(PlanInputs(num_params=1e9, num_peers=2, bandwidth_mbit=1000, step_time_s=1.0,
                                inner_steps=50, latency_s=0.5))
    assert plan.bytes_per_round == pytest.approx(4 * GB)
    assert plan.transfer_s == pytest.approx(32.5)
    assert plan.compute_s == pytest.approx(50.0)
    assert plan.utilization_none == pytest.approx(50 / 82.5)
    # delayed applies the average H/20 = 2 steps into the next round: 30.5 s of the 32.5 s are waited for there
    assert plan.overlap_steps == 2
    assert plan.wait_per_round_s_delayed == pytest.approx(30.5)
    assert plan.utilization_delayed == pytest.approx(50 / 80.5)
    assert plan.mbit_to_hide_delayed == pytest.approx(32e3 / 1.5)  # 32 Gbit in the 2 s window after the latency
    assert plan.utilization_eager == pytest.approx(1.0)  # eager applies it a whole round later
    assert plan.wait_per_round_s_eager == 0.0
    assert plan.min_inner_steps_to_hide == 33  # 32.5 s of transfer, 1 s steps
    whole = make_plan(replace(plan.inputs, overlap_steps=50))  # delayed with overlap_steps = H hides as eager does
    assert whole.utilization_delayed == pytest.approx(1.0) and whole.wait_per_round_s_delayed == 0.0


def test_four_peers_send_one_and_a_half_contributions():
    # N=4: 2 * 3/4 * 1e9 * 16/8 = 3 GB per round; 24 Gbit over 100 Mbit/s = 240 s, plus 1 s latency
    plan = make_plan(PlanInputs(num_params=1e9, num_peers=4, bandwidth_mbit=100, step_time_s=2.0,
                                inner_steps=100, bits_per_param=16, latency_s=1.0))
    assert plan.bytes_per_round == pytest.approx(3 * GB)
    assert plan.transfer_s == pytest.approx(241.0)
    assert plan.compute_s == pytest.approx(200.0)
    assert plan.utilization_none == pytest.approx(200 / 441)
    assert plan.wait_per_round_s_delayed == pytest.approx(241.0 - 5 * 2.0)  # applied H/20 = 5 steps in
    assert plan.utilization_delayed == pytest.approx(200 / 431)
    assert plan.utilization_eager == pytest.approx(200 / 241)
    assert plan.wait_per_round_s_eager == pytest.approx(41.0)
    assert plan.min_inner_steps_to_hide == 121  # 120 * 2 s = 240 < 241 <= 242


def test_allreduce_baseline_speedup_and_bytes_ratio():
    # fp32 gradients each step over N=4: 2 * 3/4 * 1e9 * 4 = 6 GB = 48 Gbit -> 480 s per 2 s step at 100 Mbit/s
    inputs = PlanInputs(num_params=1e9, num_peers=4, bandwidth_mbit=100, step_time_s=2.0, inner_steps=100,
                        bits_per_param=16, latency_s=1.0)
    plan = make_plan(inputs)
    assert plan.allreduce_bytes_per_step == pytest.approx(6 * GB)
    assert plan.allreduce_comm_s_per_step == pytest.approx(480.0)
    assert plan.utilization_allreduce == pytest.approx(2 / 482)
    assert plan.speedup_delayed == pytest.approx((200 / 431) / (2 / 482))
    assert plan.speedup_eager == pytest.approx((200 / 241) / (2 / 482))
    assert plan.speedup_none == pytest.approx((200 / 441) / (2 / 482))
    assert plan.bytes_ratio == pytest.approx(6 * GB * 100 / (3 * GB))


def test_stages_share_the_link_so_the_total_is_unchanged():
    one, eight = (make_plan(PlanInputs(num_params=8e9, num_stages=p)) for p in (1, 8))
    assert eight.bytes_per_round == one.bytes_per_round
    assert eight.transfer_s == one.transfer_s
    assert eight.bytes_per_stage_round == pytest.approx(one.bytes_per_round / 8)


@pytest.mark.parametrize("step_time_s, inner_steps", [(1.0, 50), (0.3, 7), (10.0, 400), (0.01, 1000)])
def test_eager_is_fully_utilized_exactly_when_compute_covers_the_transfer(step_time_s, inner_steps):
    plan = make_plan(PlanInputs(num_params=2e9, num_peers=3, bandwidth_mbit=500, step_time_s=step_time_s,
                                inner_steps=inner_steps))
    hides = plan.compute_s >= plan.transfer_s
    assert (plan.utilization_eager == 1.0) == hides
    assert plan.utilization_none < plan.utilization_delayed <= plan.utilization_eager  # overlap never loses
    assert (inner_steps >= plan.min_inner_steps_to_hide) == hides


@pytest.mark.parametrize("transfer_s, step_time_s", [(32.5, 1.0), (30.0, 0.1), (0.3, 0.1), (5.0, 7.0), (0.0, 1.0),
                                                     (1e-9, 3.0), (3424.5, 10.0)])
def test_the_hiding_h_is_minimal(transfer_s, step_time_s):
    steps = min_inner_steps_to_hide(transfer_s, step_time_s)
    assert steps >= 1
    assert transfer_s <= steps * step_time_s
    assert steps == 1 or (steps - 1) * step_time_s < transfer_s


def test_the_hiding_h_and_bits_of_a_plan_do_hide():
    inputs = PlanInputs(num_params=3e9, num_peers=5, bandwidth_mbit=200, step_time_s=0.7, inner_steps=100)
    plan = make_plan(inputs)
    hidden = make_plan(replace(inputs, inner_steps=plan.min_inner_steps_to_hide))
    not_hidden = make_plan(replace(inputs, inner_steps=plan.min_inner_steps_to_hide - 1))
    assert hidden.utilization_eager == 1.0 and not_hidden.utilization_eager < 1.0
    at_budget = make_plan(replace(inputs, bits_per_param=plan.hiding_bits_per_param))
    assert at_budget.transfer_s == pytest.approx(at_budget.compute_s)


def test_one_peer_has_nothing_to_average():
    plan = make_plan(PlanInputs(num_params=1e9, num_peers=1))
    assert plan.nothing_to_average
    assert plan.bytes_per_round == 0 and plan.transfer_s == 0 and plan.allreduce_bytes_per_step == 0
    assert plan.utilization_none == plan.utilization_delayed == plan.utilization_allreduce == 1.0
    assert plan.bytes_ratio is None and plan.hiding_bits_per_param is None
    assert "nothing to average" in format_plan(plan)


def test_preset_parameter_count_matches_the_model_code():
    from p2p_diloco.model.llama import ModelArgs
    from p2p_diloco.model.presets import PRESETS, estimate_num_params

    for name, shape in PRESETS.items():
        for vocab_size in (257, 32000):
            assert preset_num_params(name, vocab_size) == estimate_num_params(ModelArgs(**shape, vocab_size=vocab_size))
    assert preset_num_params("1b", 32000) == pytest.approx(1.1e9, rel=0.01)
    with pytest.raises(ConfigError, match="--preset"):
        preset_num_params("huge", 257)


@pytest.mark.parametrize("field, value, option", [
    ("bandwidth_mbit", -3, "--bandwidth-mbit: must be a positive number, got -3"),
    ("bandwidth_mbit", 0.0, "--bandwidth-mbit"), ("step_time_s", math.inf, "--step-time"),
    ("num_params", math.nan, "--params"), ("num_params", 0.5, "--params"), ("num_peers", 0, "--peers"),
    ("inner_steps", 0, "--h"), ("num_stages", 0, "--stages"), ("bits_per_param", -1, "--bits-per-param"),
    ("allreduce_bits", 0, "--allreduce-bits"), ("latency_s", -0.1, "--latency-s"), ("num_peers", 2.5, "--peers"),
    ("latency_per_peer_s", -1.0, "--latency-per-peer-s"),
])
def test_bad_inputs_name_their_option(field, value, option):
    with pytest.raises(ConfigError, match=option.replace("-", r"\-")):
        make_plan(replace(PlanInputs(num_params=1e9), **{field: value}))


def test_matchmaking_time_per_peer_adds_to_the_latency_of_larger_groups():
    """benchmarks/scale.py measures matchmaking time growing with N: --latency-per-peer-s adds it per group member."""
    base = PlanInputs(num_params=1e9, num_peers=16, latency_s=0.5, step_time_s=1.0, inner_steps=50)
    flat, grown = make_plan(base), make_plan(replace(base, latency_per_peer_s=0.25))
    assert grown.transfer_s == pytest.approx(flat.transfer_s + 0.25 * 16)
    assert grown.wait_per_round_s_none == pytest.approx(flat.wait_per_round_s_none + 4.0)
    assert grown.hiding_bits_per_param < flat.hiding_bits_per_param  # less of the round is left for the bytes
    assert "0.25 s x 16 peers" in format_plan(grown)


def test_zero_latency_is_allowed():
    assert make_plan(PlanInputs(num_params=1e9, latency_s=0.0)).transfer_s == pytest.approx(32.0)


def test_paper_setting_takes_given_values_and_states_the_rest():
    inputs = paper_inputs({"step_time_s": 4.0, "num_peers": 3})
    assert inputs.num_params == PAPER_NUM_PARAMS and inputs.bandwidth_mbit == 1000
    assert inputs.step_time_s == 4.0 and inputs.num_peers == 3
    notes = "\n".join(inputs.notes)
    assert "--h 50" in notes and "--bits-per-param 32" in notes
    assert "--step-time" not in notes and "--peers" not in notes
    text = format_plan(make_plan(inputs))
    assert f"DiLoCoX paper (arXiv 2506.21263): {PAPER_SPEEDUP:g}x over vanilla AllReduce" in text
    with pytest.raises(ConfigError, match="--bandwidth-mbit"):
        paper_inputs({"bandwidth_mbit": 100.0})


def test_json_dict_has_every_output():
    plan = make_plan(PlanInputs(num_params=1e9))
    out = json.loads(json.dumps(plan_as_dict(plan)))
    assert out["bytes_per_round"] == plan.bytes_per_round and out["inputs"]["num_params"] == 1e9


@pytest.fixture
def plan_cli(capsys):
    """``p2p-diloco plan ARGS`` through the CLI's ``main``, in this process (a new one costs seconds of imports):
    its exit code, stdout and stderr."""
    def run(*args: str) -> SimpleNamespace:
        try:
            code = main(["plan", *args])
        except SystemExit as e:  # argparse's own exits: --help
            code = e.code
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run


def test_cli_help(plan_cli):
    result = plan_cli("--help")
    assert result.returncode == 0 and "--bandwidth-mbit" in result.stdout and "--paper" in result.stdout


def test_cli_prints_a_table(plan_cli):
    result = plan_cli("--params", "1.1e9", "--peers", "4", "--bandwidth-mbit", "100", "--step-time", "2")
    assert result.returncode == 0, result.stderr
    for text in ("sent per peer per round", "GB", " s ", "%", "delayed over AllReduce"):
        assert text in result.stdout


def test_cli_paper_shows_the_comparison(plan_cli):
    result = plan_cli("--paper")
    assert result.returncode == 0, result.stderr
    assert "DiLoCoX paper (arXiv 2506.21263): 357x over vanilla AllReduce" in result.stdout
    assert "assumed --step-time" in result.stdout


def test_cli_json(plan_cli):
    result = plan_cli("--preset", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for key in ("bytes_per_round", "transfer_s", "compute_s", "min_inner_steps_to_hide", "utilization_none",
                "utilization_delayed", "utilization_eager", "allreduce_bytes_per_step", "utilization_allreduce",
                "speedup_delayed", "bytes_ratio", "inputs"):
        assert key in out
    assert out["inputs"]["num_params"] == preset_num_params("tiny", 257)


@pytest.mark.parametrize("args, option", [(("--params", "1e9", "--bandwidth-mbit", "-3"), "--bandwidth-mbit"),
                                          ((), "--params"), (("--paper", "--params", "1e9"), "--paper")])
def test_cli_bad_value_is_one_line_error(args, option, plan_cli):
    result = plan_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}:")


def test_streaming_sync_sends_a_fragment_at_a_time():
    """F fragments: the peak per averaging is the largest fragment's share; in delayed mode each of the F averagings
    has min(M, H/F) steps to arrive. Hand-computed: 1e9 fp32 params over 2 peers = 4 GB = 32 Gbit per round."""
    base = PlanInputs(num_params=1e9, num_peers=2, bandwidth_mbit=1000, step_time_s=1.0, inner_steps=50, latency_s=0.5)
    one, four = make_plan(base), make_plan(replace(base, num_fragments=4))
    assert one.peak_bytes == one.bytes_per_round and one.wait_per_round_s_streaming == one.wait_per_round_s_delayed
    assert four.peak_bytes == pytest.approx(1 * GB)  # 1/4 of 4 GB
    # each fragment: 8 Gbit = 8 s + 0.5 s latency, 2 steps (M = 2 < H/F = 12) to arrive: 6.5 s waited, 4 times
    assert four.wait_per_round_s_streaming == pytest.approx(4 * 6.5)
    assert four.utilization_streaming == pytest.approx(50 / 76)
    assert four.mbit_to_hide_streaming == pytest.approx(8e3 / 1.5)
    uneven = make_plan(replace(base, num_fragments=4, fragment_share=0.4))
    assert uneven.peak_bytes == pytest.approx(1.6 * GB)
    wide = make_plan(replace(base, num_fragments=4, overlap_steps=40))  # the window is H/F = 12 steps at most
    assert wide.wait_per_round_s_streaming == 0.0 and wide.mbit_to_hide_streaming == pytest.approx(8e3 / 11.5)
    text = format_plan(four)
    assert "Streaming sync, 4 fragments" in text and "peak sent per averaging" in text
    for bad, message in ((dict(num_fragments=51), "--fragments: streaming 51 fragments needs --h >= 51"),
                         (dict(num_fragments=0), "--fragments: must be an integer >= 1"),
                         (dict(overlap_steps=51), "--overlap-steps: must be an integer between 1 and --h (50)"),
                         (dict(num_fragments=4, fragment_share=0.1), "--fragments: the largest fragment's share")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            make_plan(replace(base, **bad))


def test_plan_with_a_preset_takes_the_largest_fragment_of_its_model(plan_cli):
    """The tiny preset with a 4096-token vocabulary: embedding and head are the largest parts, 4 fragments cut
    [embedding | blocks 0-1 | blocks 2-3 | head]; the share matches the quality benchmark's measured peak payload
    (benchmarks/results/quality-streaming: 0.933 MB at once, 0.250 MB per fragment, a 3.7x cut)."""
    out = plan_cli("--preset", "tiny", "--vocab-size", "4096", "--fragments", "4", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["inputs"]["fragment_share"] == pytest.approx(524416 / (524288 + 4 * 213248 + 524416))
    assert plan["peak_bytes"] == pytest.approx(plan["bytes_per_round"] * plan["inputs"]["fragment_share"])
    bad = plan_cli("--preset", "tiny", "--fragments", "9")
    assert bad.returncode == 2 and "--fragments: must lie in [1, 6]" in bad.stderr, bad.stderr
