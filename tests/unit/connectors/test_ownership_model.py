"""KV ownership (docs/architecture.md, "Who owns a KV block"): every order of the events of a few requests,
explored on the production code, and no record outliving its request.

``tests/kv_ownership_sim.py`` runs the connector's real scheduler sides, workers, readers, holders, lease tables,
read records, handshake caches and NIXL transports of a prefill and a decode engine; only NIXL's API, the side
channel, the clock and vLLM's block pools and steps are simulated. Each scope below is explored exhaustively:
its number of states is printed, and any order of events that serves wrong KV, lands a READ in a block vLLM
handed out, raises inside the connector, or leaves a lease, record or block behind fails it. The checker's
own checks are shown to fire on production code broken on purpose (``monkeypatch``); ``scripts/mutate_kv.py``
breaks it file by file and shows these tests notice.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

import connectors.leases
import connectors.reads
from connectors.holder import LeaseHolder
from connectors.leases import PinAnswer
from tests.kv_ownership_sim import Scope, explore, sample
from tests.kv_probes import held_leases, holder_tracked, scheduler_tracked
from tests.unit.connectors.test_connector_scheduler import FakeRequest, fake_blocks, make_scheduler, signed

FIRST = bool(os.environ.get("PDSERVE_EXPLORE_FIRST"))
"""Stop each exploration at its first violation (``scripts/mutate_kv.py``: a mutation is killed at once)."""

SCOPES = [
    pytest.param(Scope(prompts=("A",), prefill_tp=2, faults=0, proxy_releases=False, end=2), id="TP-2 sources"),
    pytest.param(Scope(prompts=("A",), prefill_tp=1, faults=1, proxy_releases=False), id="a fault"),
    pytest.param(Scope(prompts=("A",), prefill_tp=1, faults=1, proxy_releases=False, cancels=True), id="NIXL cancels"),
    pytest.param(Scope(prompts=("A", "B"), prefill_tp=1, faults=1, proxy_releases=False, end=0), id="two requests"),
    pytest.param(Scope(prompts=("A",), samples=2, prefill_tp=1, faults=1, proxy_releases=False, end=2), id="n=2"),
    pytest.param(
        Scope(prompts=("A",), prefill_tp=1, faults=0, proxy_releases=False, prefill_restart=True, end=1),
        id="a prefill restart",
    ),  # fmt: skip
    pytest.param(
        Scope(prompts=("A",), prefill_tp=1, faults=0, proxy_releases=False, decode_restart=True, end=1),
        id="a decode restart",
    ),  # fmt: skip
]
"""Explored whole: every state, every order."""

WIDE = Scope(prompts=("A", "B"), prefill_tp=2, samples=2, faults=2, prefill_restart=True, decode_restart=True)
"""Two requests of two samples each from TP-2 sources, two faults, proxy releases, a restart of each engine: too
many states to explore whole in ``make test``; random runs of it (seeded) instead."""


@pytest.mark.parametrize("scope", SCOPES)
def test_no_order_of_events_breaks_kv_ownership(scope: Scope) -> None:
    started = time.monotonic()
    result = explore(scope, stop_at="any" if FIRST else None)
    elapsed = time.monotonic() - started
    print(f"KV ownership, {scope}: {result.states} states, {result.transitions} transitions in {elapsed:.1f} s")
    assert result.violations == {}
    assert result.states >= 100  # the exploration reached the interleavings, not just the main path


@pytest.mark.parametrize("seed", [1, 2])
def test_random_runs_of_two_requests_samples_restarts_and_faults_break_nothing(seed: int) -> None:
    started = time.monotonic()
    result = sample(WIDE, walks=150, seed=seed)
    elapsed = time.monotonic() - started
    print(f"KV ownership, {WIDE}, 150 runs: {result.states} states, {result.transitions} events in {elapsed:.1f} s")
    assert result.violations == {}


ONE = Scope(prompts=("A",), prefill_tp=1, faults=1)


@pytest.mark.parametrize(
    ("target", "name", "broken", "kind"),
    [
        pytest.param(connectors.reads, "drained", lambda read: True, "landed-in-reused", id="an abort counted drained"),
        pytest.param(
            connectors.leases.LeaseTable,
            "pin",
            lambda self, *args: PinAnswer.OK,
            "served-wrong-kv",
            id="a pin granted on blocks not held",
        ),  # fmt: skip
    ],
)
def test_the_checks_fire_on_broken_production_code(monkeypatch, target, name, broken, kind) -> None:
    monkeypatch.setattr(target, name, broken)
    result = explore(ONE, stop_at=kind)
    assert kind in result.violations, result.violations
    print(f"{kind}: {' -> '.join(result.violations[kind])}")


# ---------------------------------------------------------------- the scheduler side: one record per request


def test_a_decode_request_aborted_before_allocation_releases_its_blocks_and_leaves_nothing() -> None:
    scheduler = make_scheduler()
    sent: list[str] = []
    scheduler._releases.release = lambda endpoint, request_id, by=None: sent.append(request_id)
    request = FakeRequest(kv_transfer_params=signed(), status=RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (300, True)

    _, params = scheduler.request_finished(request, [])  # aborted before update_state_after_alloc

    assert sent == ["req-on-prefill"]  # released, not taken for a replay of itself
    assert params == {"pdserve_kv": {"source": "none", "reason": "finished before loading"}}
    assert scheduler.take_stats() is None  # nothing refused
    assert scheduler_tracked(scheduler) == 0


def test_ten_thousand_requests_with_random_aborts_preemptions_and_releases_leave_nothing_keyed_by_id() -> None:
    rng = random.Random(46)
    decode = make_scheduler()
    decode._releases.release = lambda *args, **kwargs: None
    prefill = make_scheduler()
    holder = LeaseHolder("prefill", lease_ttl_s=0.05, grace_s=0.01)
    transports = type("T", (), {"poll_notifications": staticmethod(list)})()
    for i in range(10_000):
        rid = f"r{i}"
        # prefill: the request finishes and its blocks are held; a reader pins, reads, releases, or nobody comes
        prefill_request = FakeRequest(request_id=rid, kv_transfer_params={"do_remote_decode": True})
        delay, params = prefill.request_finished(prefill_request, [1, 2])
        holder.hold(rid, prefill.build_connector_meta().reqs_to_hold[rid])
        fate = rng.random()
        if fate < 0.4:
            assert holder.pin(f"decode/rank0 {rid} {prefill.epoch}") == PinAnswer.OK.value.encode()
            holder.add_notification("decode/rank0", b"PDRD 1 decode/rank0 " + rid.encode())
        elif fate < 0.7:
            holder.releases_in.put(rid if rng.random() < 0.5 else f"{rid} decode/rank0")
        holder.poll(transports)
        # decode: the same request, aborted or preempted at a random point
        request = FakeRequest(request_id=rid, kv_transfer_params=dict(signed(remote_request_id=rid)))
        decode.get_num_new_matched_tokens(request, 0)
        stage = rng.random()
        if stage > 0.2:
            decode.update_state_after_alloc(request, fake_blocks((3, False), (4, False)), 300)
            decode.build_connector_meta()
            if stage > 0.5:  # preempted and scheduled again: no second load
                assert decode.get_num_new_matched_tokens(request, 0) == (0, False)
            outcome = "finished_recving" if stage > 0.6 else "failed_recving"
            decode.update_connector_output(KVConnectorOutput(**{outcome: {rid}}))
        request.status = rng.choice([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED])
        decode.request_finished(request, [3, 4])
    time.sleep(0.1)
    holder.poll(transports)  # the leases nobody read or released end by expiry

    assert scheduler_tracked(decode) == 0 and scheduler_tracked(prefill) == 0
    assert holder_tracked(holder) == 0 and held_leases(holder._leases) == 0
    stats = decode.take_stats()
    assert stats is None or not stats.data.get("refused")  # no request taken for a replay of itself
