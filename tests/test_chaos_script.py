"""The bookkeeping of scripts/chaos.py (no swarm: the runs themselves are in docs/results.md)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_chaos_script", ROOT / "scripts" / "chaos.py")
chaos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)


def test_session_scripts_have_an_aborted_turn_and_fit_the_context():
    scripts = chaos.make_session_scripts(768, 20, seed=3)
    for script in scripts:
        checked = [t for t in script if not t["abort"]]
        assert len(checked) == 3 and any(t["abort"] for t in script)
        assert all(3 <= len(t["ids"]) <= 6 for t in script)
        # the history never holds more than the checked turns, and an aborted turn still has room to stream
        assert sum(len(t["ids"]) + chaos.SESSION_TURN_TOKENS for t in checked) + 6 + 16 <= 64


def test_session_reference_ignores_aborted_turns():
    script = [{"ids": [1, 2], "abort": True}, {"ids": [3], "abort": False}, {"ids": [9, 9], "abort": True},
              {"ids": [4], "abort": False}]
    seen = []

    def greedy(ids, n):
        seen.append(list(ids))
        return [len(ids)] * n

    assert chaos.session_reference(greedy, [script], 2) == [[None, [1, 1], None, [4, 4]]]
    assert seen == [[3], [3, 1, 1, 4]]  # aborted ids never enter the history


def test_bans_in_log_counts_per_server_and_cause():
    text = ("WARN planner: server bad-nan (QmetQURH7ScG) failed (InvalidReply: step on Qm: the reply contains NaN "
            "or inf); dropping it from the chains, banned for 5 s (strike 1)\n"
            "WARN planner: server s0 (Qme1GYK1Naef) failed; dropping it from the chains, banned for 5 s (strike 1)\n"
            "WARN planner: server bad-nan (QmetQURH7ScG) failed (InvalidReply: ...); dropping it\n")
    assert chaos.bans_in_log(text) == {"bad-nan": {"InvalidReply": 2}, "s0": {"unknown": 1}}


def test_tau_p_flags_in_log():
    text = ("WARN planner: server liar (Qmep2MvxqHaU) delivers tau_p=0.016 s, 2.4x the 0.006667 s it advertises: "
            "planning it by what it delivers\n"
            "WARN planner: server s1 (QmcNNuNJXrV2) delivers tau_p=0.04571 s, 12.3x the 0.002 s it advertises\n")
    assert chaos.tau_p_flags_in_log(text) == {"liar": [2.4], "s1": [12.3]}


def test_series_growth_is_end_minus_first_quarter_mean():
    mib = chaos.MIB
    out = chaos.series_mib([100 * mib, 104 * mib, 110 * mib, 120 * mib, 90 * mib, 121 * mib, 121 * mib, 119 * mib],
                           "x_")
    assert out == {"x_start_mib": 100.0, "x_max_mib": 121.0, "x_end_mib": 119.0, "x_growth_mib": 17.0}
    assert chaos.series_mib([], "") == {}
    own, tree = chaos.rss_bytes(os.getpid())
    assert 0 < own <= tree


def test_lost_corrupted_and_the_exit_verdict():
    report = {"requests": 10, "completed": 9, "identical_to_reference": 8,
              "sessions": {"session_turn_lost": 1, "session_open_lost": 0, "session_turns_corrupted": 2},
              "disconnects": {"completed_before_disconnect_corrupted": 1}}
    assert chaos.lost_and_corrupted(report) == (2, 4)
    clean = {"requests": 5, "completed": 5, "identical_to_reference": 5, "lost": 0, "corrupted": 0,
             "release": {"released": True}, "servers_after": {"s0": {"sessions": 0}},
             "flood": {"replies": {"untrusted": 3}}}
    assert chaos.run_ok(clean)
    assert not chaos.run_ok({**clean, "corrupted": 1})
    assert not chaos.run_ok({**clean, "release": {"released": False}})
    assert not chaos.run_ok({**clean, "servers_after": {"s0": {"sessions": 1}}})
    assert not chaos.run_ok({**clean, "flood": {"replies": {"opened": 1}}})


def test_all_faults_flag():
    args = chaos.parse_args(["--quick", "--all-faults"])
    assert args.session_aborts and args.disconnects and args.flood and args.faults
    assert args.bad_replies == ["nan", "shape"] and args.tau_p_liar == 3.0
    assert not chaos.parse_args(["--quick"]).faults
    assert chaos.parse_args(["--bad-replies", "shape"]).bad_replies == ["shape"]
    names = [s.public_name for s in chaos.fault_servers(["nan"], 0.1, 3.0, 1000, 0.002)]
    assert names == ["bad-nan", "liar"]


def test_tally_keeps_the_first_errors():
    t = chaos.Tally()
    for i in range(15):
        t.error("x", f"e{i}")
    t.inc("y", 2)
    assert t["x"] == 15 and t["y"] == 2 and t["missing"] == 0 and len(t.errors) == 10


def test_monitor_counts_bans_per_process_and_sums_them_per_name():
    mon = chaos.Monitor.__new__(chaos.Monitor)
    mon.views = {}
    for banned in (True, False, True):  # the old process of s0 banned twice; the new one never
        mon.observe({"peer_id": "old", "public_name": "s0", "banned": banned, "strikes": 2, "tau_p_suspect": False,
                     "tau_p_advertised": 0.002, "tau_p_measured": None})
        mon.observe({"peer_id": "new", "public_name": "s0", "banned": False, "strikes": 0, "tau_p_suspect": True,
                     "tau_p_advertised": 0.002, "tau_p_measured": 0.01})
    assert mon.servers() == {"s0": {"processes": 2, "bans_seen": 2, "max_strikes": 2, "tau_p_suspect_seen": True,
                                    "tau_p_advertised": 0.002, "tau_p_measured": 0.01}}
