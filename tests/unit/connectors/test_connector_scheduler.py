"""The scheduler side of our connector, against fake requests and blocks (no engine)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from connectors.metadata import KVTransferParams, PdserveConnectorMetadata  # noqa: E402
from connectors.scheduler import PdserveScheduler  # noqa: E402
from connectors.side_messages import report_key  # noqa: E402
from connectors.stats import PdserveWorkerMeta  # noqa: E402
from contract import wire  # noqa: E402
from contract.auth import KVAuth  # noqa: E402
from contract.kv_report import KVReport  # noqa: E402
from tests.kv_probes import scheduler_tracked  # noqa: E402
from tests.unit.conftest import TEST_SECRET  # noqa: E402


def signed(**fields: Any) -> dict[str, Any]:
    """``REMOTE`` with ``fields``, as a prefill engine of the test cluster issues them (MAC'd)."""
    return KVAuth(TEST_SECRET).sign_params(dict(REMOTE, **fields), ttl_s=120)


REMOTE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine",
    "remote_request_id": "req-on-prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 17600,
    "remote_block_ids": [7, 8, 9],
    "remote_num_tokens": 300,
    "tp_size": 1,
}


@dataclass
class FakeRequest:
    request_id: str = "req-1"
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(300)))
    kv_transfer_params: dict[str, Any] | None = None
    status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED
    num_computed_tokens: int = 300


def fake_blocks(*blocks: tuple[int, bool]) -> SimpleNamespace:
    """KVCacheBlocks of one group: (block_id, is a local prefix-cache hit)."""
    group = [SimpleNamespace(block_id=b, block_hash=("h" if hit else None), is_null=False) for b, hit in blocks]
    return SimpleNamespace(blocks=(group,))


BLOCK_SIZE = 128


def make_scheduler(tp_size: int = 1, block_size: int = BLOCK_SIZE) -> PdserveScheduler:
    extra = {"side_channel_host": "10.0.0.5", "side_channel_port": 17600}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size),
        cache_config=SimpleNamespace(block_size=block_size),
    )
    return PdserveScheduler(config, "engine-a")


@pytest.fixture
def scheduler() -> PdserveScheduler:
    return make_scheduler()


def test_decode_loads_every_prompt_token_not_computed_locally(scheduler):
    request = FakeRequest(kv_transfer_params=signed())

    assert scheduler.get_num_new_matched_tokens(request, 0) == (300, True)
    assert scheduler.get_num_new_matched_tokens(request, 128) == (172, True)
    assert scheduler.get_num_new_matched_tokens(FakeRequest(request_id="req-2"), 0) == (0, False)


def test_local_blocks_pair_with_remote_blocks_by_position_skipping_prefix_hits(scheduler):
    request = FakeRequest(kv_transfer_params=signed())

    scheduler.update_state_after_alloc(request, fake_blocks((3, True), (4, False), (5, False)), 172)
    meta = scheduler.build_connector_meta()

    [spec] = meta.reqs_to_receive
    assert (spec.local_block_ids, spec.remote_block_ids) == ((4, 5), (8, 9))
    assert spec.remote.remote_request_id == "req-on-prefill"
    assert request.kv_transfer_params["do_remote_prefill"] is False  # one transfer per request
    assert scheduler.build_connector_meta().reqs_to_receive == []


def test_prefill_keeps_the_blocks_and_says_where_they_are(scheduler):
    request = FakeRequest(kv_transfer_params={"do_remote_decode": True})

    delay_free, params = scheduler.request_finished(request, [7, 8, 9])

    assert delay_free is True
    assert wire.parse_remote_prefill(params) == KVTransferParams(
        remote_engine_id="engine-a",
        remote_request_id="req-1",
        remote_host="10.0.0.5",
        remote_port=17600,
        remote_block_ids=(7, 8, 9),
        remote_num_tokens=300,
        block_size=BLOCK_SIZE,
        pdserve_expires=params["pdserve_expires"],
        pdserve_epoch=scheduler.epoch,
        pdserve_mac=params["pdserve_mac"],
    )
    assert scheduler.build_connector_meta().reqs_to_hold == {"req-1": (7, 8, 9)}
    # MAC'd, for as long as the lease, for any decode engine (the proxy named none)
    auth = KVAuth(TEST_SECRET)
    auth.check_params(params, "any-decode-engine")
    assert params["pdserve_expires"] == pytest.approx(time.time() + scheduler.lease_ttl_s, abs=5)
    # what the proxy sends the decode engine's side channel when the stream starts, and the release: sealed
    assert auth.open(params["pdserve_report"]["message"].encode()) == (b"report", b"engine-a req-1")
    assert auth.open(params["pdserve_release"]["message"].encode()) == (b"release", b"req-1")


def test_prefill_binds_its_parameters_to_the_decode_engine_the_proxy_named(scheduler):
    request = FakeRequest(kv_transfer_params={"do_remote_decode": True, "pdserve_reader": "decode-3"})
    _, params = scheduler.request_finished(request, [7])
    assert params["pdserve_reader"] == "decode-3"
    KVAuth(TEST_SECRET).check_params(params, "decode-3")
    decode = make_scheduler()
    decode.engine_id = "decode-4"
    other = FakeRequest(request_id="d1", kv_transfer_params=params)
    assert decode.get_num_new_matched_tokens(other, 0) == (0, False)


def refused_params(scheduler: PdserveScheduler) -> int:
    stats = scheduler.take_stats()
    return stats.data["refused"].get("params", 0) if stats else 0


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda p: p.update(remote_host="203.0.113.9"), id="foreign host"),
        pytest.param(lambda p: p.update(remote_block_ids=[1, 2, 3]), id="other blocks"),
        pytest.param(lambda p: p.update(pdserve_mac="0" * 64), id="wrong MAC"),
        pytest.param(lambda p: p.pop("pdserve_mac"), id="no MAC"),
        pytest.param(lambda p: p.update(pdserve_expires=time.time() - 1), id="expired"),
    ],
)
def test_parameters_that_do_not_hold_up_are_computed_here_and_never_released_anywhere(scheduler, tamper):
    params = signed()
    tamper(params)
    request = FakeRequest(kv_transfer_params=params)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # the prompt is computed here
    scheduler.update_state_after_alloc(request, fake_blocks((4, False)), 0)
    assert scheduler.build_connector_meta().reqs_to_receive == []
    assert refused_params(scheduler) == 1
    request.status = RequestStatus.FINISHED_STOPPED
    assert scheduler.request_finished(request, [4]) == (
        False,
        {"pdserve_kv": {"source": "recomputed", "reason": "unauthenticated"}},
    )
    assert scheduler._releases._thread is None  # nothing was sent to the forged peer


def test_a_replay_of_used_parameters_is_refused(scheduler):
    params = signed()
    first = FakeRequest(request_id="a", kv_transfer_params=dict(params))
    assert scheduler.get_num_new_matched_tokens(first, 0) == (300, True)
    replay = FakeRequest(request_id="b", kv_transfer_params=dict(params))
    assert scheduler.get_num_new_matched_tokens(replay, 0) == (0, False)
    assert refused_params(scheduler) == 1


def test_prefill_with_tp_names_every_ranks_side_channel_for_releases():
    request = FakeRequest(kv_transfer_params={"do_remote_decode": True})

    _, params = make_scheduler(tp_size=2).request_finished(request, [7])

    assert params["tp_size"] == 2
    assert params["pdserve_release"]["endpoints"] == ["tcp://10.0.0.5:17600", "tcp://10.0.0.5:17601"]


def test_a_smaller_prefill_block_size_pairs_each_local_block_with_several_remote_ones(scheduler):
    # 300 tokens in prefill blocks of 32 (10 blocks) land in decode blocks of 128 (3 blocks).
    remote = signed(remote_block_ids=list(range(40, 50)), block_size=32)
    request = FakeRequest(kv_transfer_params=remote)
    assert scheduler.get_num_new_matched_tokens(request, 128) == (172, True)

    scheduler.update_state_after_alloc(request, fake_blocks((3, True), (4, False), (5, False)), 172)

    [spec] = scheduler.build_connector_meta().reqs_to_receive
    assert spec.local_block_ids == (4, 5)
    assert spec.remote_block_ids == (44, 45, 46, 47, 48, 49)  # local 4 <- 44..47, local 5 <- 48, 49


def test_a_prefill_block_size_that_does_not_divide_ours_is_computed_locally(scheduler):
    request = FakeRequest(kv_transfer_params=signed(block_size=96))

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, fake_blocks((3, False)), 0)

    meta = scheduler.build_connector_meta()
    assert meta.reqs_to_receive == []
    # the workers learn it too: a stream's report query is answered by them
    assert meta.reports[report_key("prefill-engine", "req-on-prefill")].reason == "incompatible"
    _, params = scheduler.request_finished(FakeRequest(kv_transfer_params=request.kv_transfer_params), [3])
    assert params["pdserve_kv"]["reason"] == "incompatible"


def test_a_local_prefix_hit_of_the_whole_prompt_is_reported_without_a_read(scheduler):
    request = FakeRequest(kv_transfer_params=signed())

    scheduler.update_state_after_alloc(request, fake_blocks((3, True)), 0)

    meta = scheduler.build_connector_meta()
    assert meta.reqs_to_receive == []
    assert meta.reports == {
        report_key("prefill-engine", "req-on-prefill"): KVReport("local_prefix_cache", bytes=0, transfer_ms=0.0)
    }
    assert scheduler.build_connector_meta().reports == {}  # handed on once
    _, params = scheduler.request_finished(FakeRequest(kv_transfer_params=request.kv_transfer_params), [3])
    assert params["pdserve_kv"]["source"] == "local_prefix_cache"


@pytest.mark.parametrize("outcome", ["finished_recving", "failed_recving"])
def test_the_samples_of_an_n_request_wait_for_one_read_and_report_it(scheduler, outcome):
    """vLLM fans a request for n samples out into ``{i}_{parent}`` requests with the same parameters: one
    reads, the others are no replay; they wait for its read (None: ask again), then compute what vLLM's
    prefix cache lacks, and report the reader's load."""
    params = signed()
    reader, *siblings = (
        FakeRequest(request_id=f"{i}_chatcmpl-x-1f", kv_transfer_params=dict(params)) for i in range(3)
    )
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (300, True)
    scheduler.update_state_after_alloc(reader, fake_blocks((3, False), (4, False), (5, False)), 300)
    assert [scheduler.get_num_new_matched_tokens(s, 0) for s in siblings] == [(None, False)] * 2
    assert [spec.request_id for spec in scheduler.build_connector_meta().reqs_to_receive] == [reader.request_id]
    report = KVReport("transfer", bytes=1000, transfer_ms=2.0, remote_engine_id="prefill-engine")
    meta = PdserveWorkerMeta({reader.request_id: report} if outcome == "finished_recving" else {})
    scheduler.update_connector_output(
        KVConnectorOutput(**{outcome: {reader.request_id}}, kv_connector_worker_meta=meta)
    )

    assert [scheduler.get_num_new_matched_tokens(s, 0) for s in siblings] == [(0, False)] * 2
    scheduler.update_state_after_alloc(siblings[0], fake_blocks((3, True), (4, True), (6, False)), 0)
    assert scheduler.build_connector_meta().reqs_to_receive == []
    assert refused_params(scheduler) == 0
    finished = [scheduler.request_finished(r, [3, 4])[1] for r in (siblings[0], reader, siblings[1])]
    expected = {"pdserve_kv": report.as_dict()} if outcome == "finished_recving" else None
    assert finished == [expected] * 3
    assert scheduler_tracked(scheduler) == 0  # every record ended with its request


def test_the_same_parameters_in_a_request_of_another_parent_are_a_replay(scheduler):
    params = signed()
    assert scheduler.get_num_new_matched_tokens(FakeRequest("0_chatcmpl-x-1f", kv_transfer_params=dict(params)), 0)[0]
    for request_id in ("1_chatcmpl-y-2e", "chatcmpl-x-1f", "a_chatcmpl-x-1f"):
        assert scheduler.get_num_new_matched_tokens(FakeRequest(request_id, kv_transfer_params=dict(params)), 0) == (
            0,
            False,
        )
    assert refused_params(scheduler) == 3


def test_the_ranks_reports_of_one_load_add_up_when_they_come_in_different_steps(scheduler):
    request = FakeRequest(kv_transfer_params=signed())
    scheduler.update_state_after_alloc(request, fake_blocks((3, False), (4, False), (5, False)), 300)
    part = KVReport("transfer", bytes=1000, transfer_ms=2.0, remote_engine_id="prefill-engine")

    for rank_part, finished in ((part, set()), (dataclasses.replace(part, transfer_ms=3.5), {"req-1"})):
        scheduler.update_connector_output(
            KVConnectorOutput(
                finished_recving=finished, kv_connector_worker_meta=PdserveWorkerMeta({"req-1": rank_part})
            )
        )
    _, params = scheduler.request_finished(FakeRequest(kv_transfer_params=request.kv_transfer_params), [3, 4, 5])

    assert params["pdserve_kv"] == part.as_dict() | {"bytes": 2000, "transfer_ms": 3.5}


def test_an_aborted_prefill_frees_its_blocks_at_once(scheduler):
    request = FakeRequest(kv_transfer_params={"do_remote_decode": True}, status=RequestStatus.FINISHED_ABORTED)

    assert scheduler.request_finished(request, [7, 8, 9]) == (False, None)
    assert scheduler.build_connector_meta().reqs_to_hold == {}


def test_incomplete_params_are_refused_with_the_missing_fields():
    with pytest.raises(wire.InvalidTransferParams, match="remote_host, remote_port"):
        wire.parse_remote_prefill(
            {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r", "remote_block_ids": [1]}
        )


# --- bad input is refused, never raised into vLLM's engine core (issue 29) ----------------------------------

ENGINE_KILLERS = [
    {"remote_block_ids": 5},
    {"remote_block_ids": "1,2,3"},
    {"remote_block_ids": [None]},
    {"remote_block_ids": [[1], [2]]},
    {"remote_block_ids": [2**40]},
    {"remote_port": "17600"},
    {"remote_port": 70000},
    {"remote_port": True},
    {"tp_size": 0},
    {"tp_size": "2"},
    {"block_size": -128},
    {"remote_num_tokens": [1]},
    {"remote_engine_id": {"a": 1}},
    {"remote_host": ["h"]},
    {"remote_request_id": "has space"},
    {"pdserve_expires": "soon"},
    {"pdserve_mac": 7},
]


@pytest.mark.parametrize("bad", ENGINE_KILLERS, ids=lambda bad: "-".join(f"{k}={v!r}" for k, v in bad.items()))
def test_a_field_of_the_wrong_type_or_range_is_refused_and_the_prompt_computed_here(scheduler, bad):
    request = FakeRequest(kv_transfer_params=dict(signed(), **bad))

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, fake_blocks((4, False)), 0)
    assert scheduler.build_connector_meta().reqs_to_receive == []
    assert scheduler.take_stats().data["refused"] == {"malformed_params": 1}
    assert scheduler.request_finished(request, [4]) == (
        False,
        {"pdserve_kv": {"source": "recomputed", "reason": "malformed"}},
    )


@pytest.mark.parametrize("raw", ["do_remote_prefill", 5, ["do_remote_prefill"], {"do_remote_prefill": "yes"}])
def test_params_that_are_not_a_mapping_or_do_not_ask_plainly_are_no_pd(scheduler, raw):
    request = FakeRequest(kv_transfer_params=raw)

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert scheduler.request_finished(request, [4]) == (False, None)


@pytest.mark.parametrize(
    "raw", ["do_remote_decode", {"do_remote_decode": 1}, {"do_remote_decode": True, "pdserve_reader": 5}]
)
def test_a_prefill_request_with_odd_params_never_raises(scheduler, raw):
    delay_free, issued = scheduler.request_finished(FakeRequest(kv_transfer_params=raw), [1, 2])

    if delay_free:  # a plain ask with a reader of the wrong type: offered to any reader
        assert "pdserve_reader" not in issued
    else:
        assert issued is None


def test_a_failure_while_planning_the_read_fails_the_load_instead_of_the_engine(scheduler):
    request = FakeRequest(kv_transfer_params=signed())
    broken_blocks = SimpleNamespace(blocks=None)  # vLLM handed something we did not expect

    scheduler.update_state_after_alloc(request, broken_blocks, 172)

    [spec] = scheduler.build_connector_meta().reqs_to_receive
    assert spec.request_id == "req-1" and spec.failure.startswith("TypeError")


def test_whatever_our_code_raises_stays_inside_the_connector():
    from connectors.stats import PdserveKVStats
    from connectors.vllm_connector import PdserveConnector

    class Broken:
        def __getattr__(self, name):
            def raises(*args, **kwargs):
                raise RuntimeError(f"a bug in {name}")

            return raises

    connector = PdserveConnector.__new__(PdserveConnector)  # without vLLM's config: only the boundary
    connector.engine_id, connector._internal_errors = "engine-a", PdserveKVStats()
    connector._scheduler, connector._worker = Broken(), None
    request = FakeRequest(kv_transfer_params=signed())

    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert connector.update_state_after_alloc(request, fake_blocks((4, False)), 300) is None
    assert connector.request_finished(request, [4]) == (False, None)
    assert connector.update_connector_output(SimpleNamespace()) is None
    assert connector.build_connector_meta(SimpleNamespace()).reqs_to_receive == []
    connector._scheduler, connector._worker = None, Broken()
    assert connector.get_block_ids_with_load_errors() == set()
    assert not connector.get_transfer_results(set()).finished_recving
    connector.bind_connector_metadata(PdserveConnectorMetadata())  # the step's work begins here
    connector._worker = SimpleNamespace(take_stats=lambda: None)
    assert connector.get_kv_connector_stats().data["failures"] == {"internal": 8}


def test_a_steps_work_begins_when_its_metadata_is_bound_before_the_forward():
    """vLLM calls ``start_load_kv`` after the forward for async loads; holds and pins begin at the bind."""
    from connectors.stats import PdserveKVStats
    from connectors.vllm_connector import PdserveConnector

    begun: list[PdserveConnectorMetadata] = []
    connector = PdserveConnector.__new__(PdserveConnector)
    connector.engine_id, connector._internal_errors = "engine-a", PdserveKVStats()
    connector._scheduler, connector._worker = None, SimpleNamespace(start_load_kv=begun.append)
    metadata = PdserveConnectorMetadata(reqs_to_hold={"req-1": [4, 5]})

    connector.bind_connector_metadata(metadata)
    assert begun == [metadata]
    connector.start_load_kv(SimpleNamespace())  # after the forward: nothing more
    assert begun == [metadata]


def test_genuine_parameters_whose_lease_is_over_are_recomputed_as_expired(scheduler):
    request = FakeRequest(kv_transfer_params=KVAuth(TEST_SECRET).sign_params(dict(REMOTE), ttl_s=-1))

    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    assert refused_params(scheduler) == 1
    assert scheduler.request_finished(request, [4]) == (
        False,
        {"pdserve_kv": {"source": "recomputed", "reason": "expired"}},
    )


def test_a_sample_first_seen_after_its_reader_ended_is_no_replay(scheduler):
    """vLLM may schedule a sample of an n>1 request only after the sample that read the KV finished: its
    prompt is then in vLLM's prefix cache, and its parameters are its parent's, not a replay."""
    params = signed()
    reader, late = (FakeRequest(request_id=f"{i}_chatcmpl-y-2a", kv_transfer_params=dict(params)) for i in range(2))
    assert scheduler.get_num_new_matched_tokens(reader, 0) == (300, True)
    scheduler.update_state_after_alloc(reader, fake_blocks((3, False), (4, False), (5, False)), 300)
    scheduler.build_connector_meta()
    scheduler.request_finished(reader, [3, 4, 5])

    assert scheduler.get_num_new_matched_tokens(late, 0) == (0, False)
    assert refused_params(scheduler) == 0
    scheduler.request_finished(late, [3, 4])
    assert scheduler_tracked(scheduler) == 0
