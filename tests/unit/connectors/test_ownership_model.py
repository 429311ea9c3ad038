"""KV ownership (docs/architecture.md, "Who owns a KV block"): every interleaving explored, and no record outlives
its request.

``tests/ownership_model.py`` drives the real ``LeaseTable`` and ``ReadRecord`` through every order of the events
of two requests (READs that land late, fail or are aborted, proxy releases, expiry, a prefill restart). Each part of
the protocol turned off (``Knobs``) is a hole the checker must find: that is what the code did before pins, drains
and epochs.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.ownership_model import Knobs, explore

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from connectors.holder import LeaseHolder  # noqa: E402
from connectors.leases import PinAnswer  # noqa: E402
from tests.unit.connectors.test_connector_scheduler import FakeRequest, fake_blocks, make_scheduler, signed  # noqa: E402


@pytest.mark.parametrize(
    ("requests", "full", "at_least"),
    [
        pytest.param(("A",), ("A",), 1_500, id="one request, every event"),
        pytest.param(("A", "B"), (), 50_000, id="two requests and a restart, every order"),
    ],
)
def test_no_interleaving_breaks_an_invariant(requests: tuple[str, ...], full: tuple[str, ...], at_least: int) -> None:
    started = time.monotonic()
    result = explore(Knobs(), requests, full)
    elapsed = time.monotonic() - started
    print(f"ownership model {requests}: {result.states} states, {result.transitions} transitions in {elapsed:.1f} s")
    assert result.violations == {}
    assert result.states >= at_least  # the exploration reached the interleavings, not just the main path


@pytest.mark.parametrize(
    ("knobs", "requests", "hole"),
    [
        pytest.param(Knobs(pins=False), ("A",), "freed-under-read", id="a release frees blocks under a READ"),
        pytest.param(Knobs(drains=False), ("A",), "landed-in-reused", id="an aborted READ lands in reused blocks"),
        pytest.param(Knobs(epochs=False), ("A", "B"), "other-start", id="a reader keeps a restarted peer's mapping"),
    ],
)
def test_the_checker_finds_each_hole_the_protocol_closes(knobs: Knobs, requests: tuple[str, ...], hole: str) -> None:
    full = ("A",) if len(requests) == 1 else ()
    result = explore(knobs, requests, full, stop_at=hole)
    assert hole in result.violations, result.violations
    print(f"{hole}: {' -> '.join(result.violations[hole])}")


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
    assert scheduler.tracked() == 0


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

    assert decode.tracked() == 0 and prefill.tracked() == 0
    assert holder.tracked() == 0 and len(holder.leases) == 0
    stats = decode.take_stats()
    assert stats is None or not stats.data.get("refused")  # no request taken for a replay of itself
