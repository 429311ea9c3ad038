"""The simulator's role moves: the controller's rules (``rules.moves_for``, ``rules.move_order``, a moving engine
counted in its new pool), an engine finishing its old work (a prefill engine's KV read too) before it serves in
the new pool ``move_s`` later, and a move called off by a retirement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from orchestrator.autoscale.profile import DEFAULT_MOVE_S, PerformanceProfile, ProfileError, load_profile
from orchestrator.autoscale.simulator import SimOptions, Simulator
from orchestrator.autoscale.traces import TraceRequest
from testlib.profiles import INSTANT, TARGETS, Script, make_profile, poisson_trace

MOVE_S = 2.0


def moving_profile(startup_s: float = 30.0, handoff_s: float = 0.0) -> PerformanceProfile:
    """Instant prefill, 0.1-s decode steps of any batch, a 30-s start-up and a 2-s switch between pools."""
    base = make_profile(prefill_s_per_token=INSTANT, decode_step=(0.1, 0.0), max_num_seqs=1000, startup_s=startup_s)
    return dataclasses.replace(base, engine=dataclasses.replace(base.engine, move_s=MOVE_S, handoff_s=handoff_s))


def run(sizes, initial, trace, moves=True, **kwargs) -> tuple[Simulator, Script]:
    policy = Script(sizes)
    sim = Simulator(
        kwargs.pop("profile", moving_profile()), policy, TARGETS, initial, SimOptions(interval_s=10.0, moves=moves)
    )
    sim.run(trace)
    return sim, policy


def short_requests() -> list[TraceRequest]:
    return poisson_trace(2.0, 200, prompt=lambda rng: 10, output=lambda rng: 10)


def by_t(policy: Script, role: str) -> dict[int, tuple[int, int]]:
    return {round(o.t): (o.pool(role).replicas, o.pool(role).starting) for o in policy.seen}


def test_a_decision_that_grows_one_pool_and_shrinks_the_other_moves_the_newest_ready_engines():
    # t=10: 3:1 -> 1:3. Two prefill engines move (prefill-2, then prefill-1), none starts, none retires.
    sim, policy = run([(1, 3)], (3, 1), short_requests())
    assert sim.timeline[0]["moved"] == "prefill->decode 2"
    decode = by_t(policy, "decode")
    assert decode[20] == (3, 0)  # their short work done, they serve decode 2 s later: no 30-s start-up
    assert [(e.replica, e.state.value) for e in sim.prefill] == [(0, "serving"), (1, "stopped"), (2, "stopped")]
    assert [(e.replica, e.state.value) for e in sim.decode] == [(0, "serving"), (2, "serving"), (1, "serving")]
    assert all(t["engines"] == 4 for t in sim.timeline)  # a move neither adds an engine nor takes one


def test_without_moves_the_same_decision_drains_and_starts_engines():
    sim, policy = run([(1, 3)], (3, 1), short_requests(), moves=False)
    assert sim.timeline[0]["moved"] is None
    decode = by_t(policy, "decode")
    assert decode[20] == (1, 2)  # started at t=10, serving only after their 30-s start-up
    assert decode[50] == (3, 0)
    assert [(e.replica, e.state.value) for e in sim.decode] == [(0, "serving"), (1, "serving"), (2, "serving")]


def test_a_moving_engine_counts_in_its_new_pool_from_the_decision_and_serves_there_after_its_old_work():
    # A decode engine busy with long requests (300 tokens x 0.1 s) moves to prefill at t=10: it takes no new
    # decode request, finishes its running ones (until ~40 s), then serves prefill MOVE_S later.
    trace = [TraceRequest(t, 10, 300) for t in (1.0, 2.0)] + poisson_trace(
        1.0, 80, prompt=lambda rng: 10, output=lambda rng: 2
    )
    sim, policy = run([(2, 1)], (1, 2), trace, profile=moving_profile(startup_s=100.0))
    prefill, decode = by_t(policy, "prefill"), by_t(policy, "decode")
    assert prefill[20] == (1, 1) and decode[20] == (1, 0)  # counted as arriving in prefill, out of decode
    moved = sim.prefill[-1]
    assert (moved.replica, moved.cores_id) == (1, "decode-1")  # the newest decode engine, its cores kept
    assert moved.started == pytest.approx(10.0)  # its hours go on from the decision, in its new pool
    # The long request it runs ends at 31-32 s: at 30 s it still decodes, at 40 s it serves prefill.
    assert sorted(round(r.done) for r in sim._records if r.output_tokens == 300) == [31, 32]
    assert (prefill[30], prefill[40]) == ((1, 1), (2, 0))
    assert sum(e.hours(3600) for e in sim.decode if e.replica == 1) == pytest.approx(10.0 / 3600)


def test_a_prefill_engine_moves_only_once_the_decode_side_has_read_its_kv():
    # One decode engine with room for one sequence: of three requests prefilled at once, the second's KV is
    # read when the first's decode ends (13 s), the third's when the second's does (25 s). The prefill
    # engine, moved to decode at t=10 and idle since 1 s, holds their KV until then: it serves decode at 27 s.
    profile = moving_profile()
    profile = dataclasses.replace(profile, engine=dataclasses.replace(profile.engine, max_num_seqs=1))
    trace = [TraceRequest(t, 10, 121) for t in (1.0, 1.1, 1.2)]
    sim, policy = run([(0, 2)], (1, 1), trace, profile=profile)
    decode = by_t(policy, "decode")
    assert (decode[20], decode[30]) == ((1, 1), (2, 0))
    assert sorted(round(r.done) for r in sim._records) == [13, 25, 37]
    assert (sim.prefill[0].state.value, sim.prefill[0].unread) == ("stopped", 0)


def test_a_retirement_that_picks_a_moving_engine_calls_the_move_off():
    # t=10: prefill-1 starts moving to decode (busy decoding no more: it holds KV a slow decode has not read);
    # t=20: decode back to 1: the moving engine retires first, and drains in prefill, where it came from.
    profile = dataclasses.replace(moving_profile(), engine=dataclasses.replace(moving_profile().engine, max_num_seqs=1))
    trace = [TraceRequest(t, 10, 300) for t in (1.0, 1.1)]
    sim, policy = run([(1, 2), (1, 1)], (2, 1), trace, profile=profile)
    assert sim.timeline[0]["moved"] == "prefill->decode 1"
    assert [e.state.value for e in sim.decode] == ["serving", "stopped"]
    assert sim.decode[1].hours(3600) == 0.0
    assert sim.prefill[1].state.value == "stopped"  # drained in prefill once its KV was read, then stopped
    assert by_t(policy, "decode")[30] == (1, 0)
    assert len(sim._records) == 2


def test_only_ready_engines_move_and_the_rest_of_a_change_is_starts():
    # t=10: 1:1 -> 2:1 (prefill-1 starts: 30 s); t=20: -> 1:4. Prefill shrinks by one, decode grows by three:
    # one move, of the one ready prefill engine (prefill-0; prefill-1 still starts and stays), two starts.
    sim, policy = run([(2, 1), (1, 4)], (1, 1), short_requests())
    assert sim.timeline[1]["moved"] == "prefill->decode 1"
    assert [(e.replica, e.state.value) for e in sim.prefill] == [(0, "stopped"), (1, "serving")]
    assert by_t(policy, "decode")[30] == (2, 2)  # the moved engine serves; decode-1 and -2 start until 50 s
    assert by_t(policy, "decode")[60] == (4, 0)


def test_a_profile_without_move_s_reads_the_default_and_a_negative_one_is_refused(tmp_path: Path):
    shipped = Path(__file__).resolve().parents[4] / "configs/profiles/example-gpu.yaml"
    raw = yaml.safe_load(shipped.read_text())
    assert "move_s" not in raw["engine"]
    assert load_profile(shipped).engine.move_s == DEFAULT_MOVE_S == 0.1
    path = tmp_path / "p.yaml"
    for value, read in ((1.25, 1.25), (0, 0.0)):
        raw["engine"]["move_s"] = value
        path.write_text(yaml.safe_dump(raw))
        assert load_profile(path).engine.move_s == read
    load_profile(path).save(path)  # written with its move_s, read back the same
    assert load_profile(path).engine.move_s == 0.0
    raw["engine"]["move_s"] = -1
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ProfileError, match=r"engine\.move_s: must be 0 or more"):
        load_profile(path)


def test_a_growing_pool_moves_in_the_other_pools_kept_warm_engine_before_it_starts_one():
    # t=10: prefill 2 -> 1 (prefill-1 drains, kept warm); t=20: decode 1 -> 2 in a decision of its own. As the
    # controller does (rules.resize_plan's others), the warm prefill-1 moves in instead of a 30-s start.
    for moves, decode_at_30 in ((True, (2, 0)), (False, (1, 1))):
        policy = Script([(1, 1), (1, 2)])
        sim = Simulator(
            moving_profile(),
            policy,
            TARGETS,
            (2, 1),
            SimOptions(interval_s=10.0, moves=moves, keep_warm_s=60, max_engines=4),
        )
        sim.run(short_requests())
        assert [t["moved"] for t in sim.timeline[:2]] == [None, None]  # no decision grows and shrinks at once
        assert by_t(policy, "decode")[30] == decode_at_30  # moved: serving 2 s after; else a start under way
    cores = [(e.replica, e.cores_id) for e in sim.decode]
    assert cores == [(0, ""), (1, "")]  # without moves decode-1 started on its own cores
