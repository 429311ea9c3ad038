"""One request's exchange (``proxy.exchange``): the prefill's KV is released at most once, and exactly once
when no decode engine read it, whichever way the request ends; the exchange itself closes once.

The first tests hold a ``KVHandle`` and an ``Exchange`` with a releaser that records what it is asked; the
rest send requests through the proxy to stub engines and read the release messages the prefill engine's
side channel (a real TCP server, ``side_channel`` in conftest.py) receives.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.exchange import DECODE_ONLY, DISAGGREGATED, PREFILL_ONLY, KVHandle
from proxy.limits import AdmissionGate
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool, EngineState
from proxy.routing import NO_DECODE_ENGINE, PREFILL_FAILED, SHORT_PROMPT, Route
from tests.stub_engine import Behaviour
from tests.unit.conftest import released
from tests.unit.proxy.test_disconnect import PATIENT_S, leave_once
from tests.unit.proxy_factories import make_exchange
from tests.unit.proxy_requests import CHAT, CHAT_PATH

pytestmark = pytest.mark.timeout(15)

KV = {"remote_engine_id": "prefill-0", "pdserve_release": {"endpoints": ["tcp://127.0.0.1:9"], "message": "PDRL r"}}


class RecordingReleaser:
    """Stands for ``proxy.release.KVReleaser``: records each release it is asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[dict[str, Any], str]] = []

    def release(self, kv_params: dict[str, Any], request_id: str) -> bool:
        self.asked.append((kv_params, request_id))
        return True


# --- KVHandle ---------------------------------------------------------------------------


def test_a_release_goes_out_once_however_often_it_is_asked():
    releaser, kv = RecordingReleaser(), KVHandle("r-1")
    kv.hold(KV, releaser)  # type: ignore[arg-type]

    assert kv.release() is True
    assert kv.release() is False
    assert releaser.asked == [(KV, "r-1")]
    assert kv.params is None  # a decode engine after the release gets no transfer parameters


def test_kv_a_decode_engine_read_is_never_released():
    releaser, kv = RecordingReleaser(), KVHandle("r-2")
    kv.hold(KV, releaser)  # type: ignore[arg-type]
    kv.read()

    assert kv.release() is False
    assert releaser.asked == []
    assert kv.params is None  # read by one decode engine: no later decode leg is sent it


@pytest.mark.parametrize("answered", [None, {}], ids=["none", "empty"])
def test_nothing_is_released_where_the_prefill_kept_nothing(answered):
    releaser, kv = RecordingReleaser(), KVHandle("r-3")
    assert kv.release() is False  # decode-only: no prefill leg
    kv = KVHandle("r-3")
    kv.hold(answered, releaser)  # type: ignore[arg-type]
    assert kv.params is None and kv.release() is False
    assert releaser.asked == []


# --- Exchange ---------------------------------------------------------------------------


def engine(engine_id: str) -> EngineState:
    return EngineState(engine_id, f"http://{engine_id}:8000", "prefill" if engine_id.startswith("p") else "decode")


async def test_an_exchange_closes_once_releasing_giving_back_its_slot_and_counting_itself():
    gate, releaser, metrics = AdmissionGate(1), RecordingReleaser(), ProxyMetrics(EnginePool())
    exchange = make_exchange(headers={"X-Request-Id": "r-4"}, metrics=metrics)
    await gate.enter()
    exchange.gate = gate
    exchange.kv.hold(KV, releaser)  # type: ignore[arg-type]

    exchange.close(200)
    exchange.close(499)  # a second close (say, a stream's end after an error answer) changes nothing

    assert releaser.asked == [(KV, "r-4")]
    assert gate.running == 0
    counted = 'pdserve_proxy_requests_total{model="",path="disaggregated",route="/v1/completions",status="200"} 1.0'
    lines = metrics.render().decode().splitlines()
    assert [line for line in lines if line.startswith("pdserve_proxy_requests_total")] == [counted]


@pytest.mark.parametrize(
    ("route", "path", "header"),
    [
        (Route(engine("p"), engine("d"), ()), DISAGGREGATED, "disaggregated"),
        (Route(None, engine("d"), (), SHORT_PROMPT), DECODE_ONLY, "decode-only; reason=short-prompt"),
        (Route(None, engine("p"), (), NO_DECODE_ENGINE), PREFILL_ONLY, "prefill-only; reason=no-decode-engine"),
    ],
    ids=["disaggregated", "decode-only", "prefill-only"],
)
def test_the_engines_chosen_make_the_serving_path_and_its_headers(route, path, header):
    exchange = make_exchange()
    exchange.routed(route)

    assert exchange.serving_path == exchange.request.state.serving_path == path
    assert exchange.reply_headers == {
        "X-Request-Id": exchange.request_id, "X-PDServe-Path": header, "X-PDServe-Decode": route.decode.engine_id
    }  # fmt: skip


def test_a_degraded_exchange_names_no_prefill_engine():
    exchange = make_exchange()
    exchange.routed(Route(engine("p"), engine("d"), ()))
    exchange.reply_headers["X-PDServe-Prefill"] = "p"

    exchange.degrade(PREFILL_FAILED)

    assert exchange.serving_path == DECODE_ONLY
    assert exchange.reply_headers["X-PDServe-Path"] == "decode-only; reason=prefill-failed"
    assert "X-PDServe-Prefill" not in exchange.reply_headers


# --- every way a request ends, through the proxy ----------------------------------------


ENDINGS = {
    # name: (what the engines do, request fields, whether the client hangs up, KV released)
    "served-json": ({}, {}, False, False),
    "served-stream": ({}, {"stream": True}, False, False),
    "decode-500-json": ({"decode": Behaviour.ERROR_500}, {}, False, True),
    "decode-500-stream": ({"decode": Behaviour.ERROR_500}, {"stream": True}, False, True),
    "decode-400": ({}, {"max_tokens": 2, "min_tokens": 5}, False, True),  # the prefill drops min_tokens
    "decode-down": ({"decode": "down"}, {}, False, True),
    "decode-dies-mid-stream": ({"decode": Behaviour.DROP}, {"stream": True}, False, False),  # it had read the KV
    "client-leaves-during-decode": ({"decode": Behaviour.HANG}, {}, True, True),
    "client-leaves-before-the-first-chunk": ({"decode": Behaviour.HANG}, {"stream": True}, True, True),
    "client-leaves-during-prefill": ({"prefill": Behaviour.HANG}, {}, True, False),  # no KV issued yet
    "prefill-fails-decode-only": ({"prefill": Behaviour.ERROR_500}, {}, False, False),  # degraded: no KV
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_every_ending_releases_the_kv_exactly_once_when_unread_and_never_when_read(
    make_client, side_channel, prefill_engine, decode_engine, ending
):
    behaviours, fields, leaves, expect_release = ENDINGS[ending]
    client = await make_client(request_timeout_s=PATIENT_S if leaves else 2.0)
    engines = {"prefill": prefill_engine, "decode": decode_engine}
    for role, behaviour in behaviours.items():
        if behaviour == "down":
            await engines[role].stop()
        else:
            engines[role].behaviour = behaviour
    request_id = f"end-{ending}"

    if leaves:
        await leave_once(client, engines[next(iter(behaviours))], CHAT | fields, request_id)
    else:
        response = await client.post(CHAT_PATH, json=CHAT | fields, headers={"X-Request-Id": request_id})
        assert response.headers["x-request-id"] == request_id

    assert await released(side_channel, timeout_s=3.0 if expect_release else 0.3) == (
        [f"PDRL {request_id}"] if expect_release else []
    )
