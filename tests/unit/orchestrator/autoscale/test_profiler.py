"""``pdserve profile``'s measurement logic (``orchestrator.autoscale.profiler``) against stub engines.

The stubs play vLLM engines whose costs follow known formulas: the prefill stub
reports ``prefill_pass_s(tokens, batch)`` in ``vllm:request_prefill_time_seconds`` (and
can take two passes, or answer late from a slow front end in one),
the decode stub streams tokens ``decode_step_s(active streams, context)`` apart and
counts each KV transfer the proxy sets up in vLLM NIXL's metrics. A profile measured
against them must hold those formulas' values, and load back with ``load_profile``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from orchestrator.autoscale import profiler
from orchestrator.autoscale.profile import load_profile
from orchestrator.autoscale.profiler_grid import DEFAULT_GRID, QUICK_GRID, ProfileGrid
from orchestrator.autoscale.profiler_http import ClusterEndpoints, Http, RandomPrompts
from orchestrator.autoscale.profiler_readings import (
    DecodeRun,
    TransferSample,
    batch_limits,
    decoding_span,
    handoff_seconds,
    kv_capacity_tokens,
    read_together,
    transfer_table,
)
from orchestrator.cli import main
from orchestrator.errors import ProfilingError
from orchestrator.spec import ClusterSpec
from tests.stub_engine import ReceivedRequest, StubEngine

BYTES_PER_TOKEN = 1000
KV_CAPACITY = 23296


def prefill_pass_s(tokens: int, batch: int) -> float:
    return 0.0005 * tokens + 0.002 * batch


def decode_step_s(active: int, context: int) -> float:
    return 0.01 * active + 0.00002 * context


def transfer_s(nbytes: float) -> float:
    return 0.001 + nbytes / 1e8


def batch_of(prompt: list) -> list[list[int]]:
    """A completion request's prompts: one prompt (token ids), or a batch of them."""
    return [prompt] if isinstance(prompt[0], int) else prompt


class FakeVllm:
    """The metrics and answers of a prefill and a decode vLLM engine, installed on two stubs."""

    def __init__(self, prefill: StubEngine, decode: StubEngine) -> None:
        self.prefill_sum = self.prefill_count = self.queue_sum = 0.0
        self.transfer_sum = self.transfer_count = self.transfer_bytes = 0.0
        self.split_next = 0  # measured prefill requests still to be computed in two passes (not one pass)
        self.prefill_steps = 0  # the prefill engine's steps (vllm:iteration_tokens_total_count)
        self.front_end_s = 0.0  # what the front end adds to each measured prefill answer (one pass still)
        self.active = 0
        # The decode engine's clock: what vLLM's engine core stamps, whatever the client reads.
        self.decode_sum = self.decode_count = self.generated = self.steps = 0.0
        self.stalled = False  # the front end descheduled: every chunk of a stream reaches the client at its end
        self.extra_steps = 0  # steps beyond one pass a batch took (its prompts spread over several passes)
        self.unreadable_runs = 0  # decode batches still to take an extra step AND reach a stalled client
        prefill.handler, prefill.extra_metrics = self.prefill, self.prefill_metrics
        decode.handler, decode.extra_metrics = self.decode, self.decode_metrics

    async def prefill(self, request: web.Request, received: ReceivedRequest) -> web.StreamResponse | None:
        if received.is_prefill:  # the proxy's prefill leg: recorded, and the stub's usual answer
            self.prefill_sum += prefill_pass_s(len(received.body["prompt"]), 1)
            self.prefill_count += 1
            self.prefill_steps += 1
            return None
        prompts = batch_of(received.body["prompt"])
        batch, tokens = len(prompts), sum(len(p) for p in prompts)
        steps = 1
        if self.split_next and tokens > 16:  # not the warm-up: its prompts took two passes
            self.split_next -= 1
            steps = 2
            await asyncio.sleep(2 * prefill_pass_s(tokens, batch))
        await asyncio.sleep(self.front_end_s)
        self.prefill_sum += batch * prefill_pass_s(tokens, batch)
        self.prefill_count += batch
        self.prefill_steps += steps
        return web.json_response({"choices": [{"index": i, "text": "x"} for i in range(batch)]})

    def prefill_metrics(self) -> str:
        return (
            f"vllm:request_prefill_time_seconds_sum {self.prefill_sum}\n"
            f"vllm:request_prefill_time_seconds_count {self.prefill_count}\n"
            f"vllm:request_queue_time_seconds_sum {self.queue_sum}\n"
            f"vllm:request_queue_time_seconds_count {self.prefill_count}\n"
            "vllm:prefix_cache_hits_total 0.0\n"
            f"vllm:iteration_tokens_total_count {self.prefill_steps}\n"
        )

    async def decode(self, request: web.Request, received: ReceivedRequest) -> web.StreamResponse | None:
        body = received.body
        if received.kv_transfer_params:  # the proxy's decode leg: the KV comes over
            nbytes = BYTES_PER_TOKEN * len(body["prompt"])
            self.transfer_sum += transfer_s(nbytes)
            self.transfer_count += 1
            self.transfer_bytes += nbytes
            return None
        prompts = batch_of(body["prompt"])
        batch, context = len(prompts), len(prompts[0])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.active += batch
        chunks, decoding_s = [], 0.0
        try:
            for generated in range(1, body["max_tokens"] + 1):
                if generated > 1:
                    step = decode_step_s(self.active, context)
                    await asyncio.sleep(step)
                    decoding_s += step
                for index in range(batch):  # one chunk a choice, as vLLM streams a list of prompts
                    chunk = {"choices": [{"index": index, "text": "x"}], "usage": {"completion_tokens": generated}}
                    chunks.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if not (self.stalled or self.unreadable_runs):
                    await response.write(b"".join(chunks))
                    chunks.clear()
        finally:
            self.active -= batch
        for chunk in chunks:  # a stalled front end's: all at once
            await response.write(chunk)
        self.decode_sum += batch * decoding_s
        self.decode_count += batch
        self.generated += batch * body["max_tokens"]
        if not self.active:  # the last of a batch: the steps of its pass, as one engine counts them
            extra = self.extra_steps or (1 if self.unreadable_runs else 0)
            self.steps += body["max_tokens"] + (extra if body["max_tokens"] > 1 else 0)
            if self.unreadable_runs and body["max_tokens"] > 1:
                self.unreadable_runs -= 1
        await response.write(b"data: [DONE]\n\n")
        return response

    def decode_metrics(self) -> str:
        return (
            f'vllm:cache_config_info{{block_size="128",engine="0",kv_cache_size_tokens="{KV_CAPACITY}"}} 1.0\n'
            f"vllm:nixl_xfer_time_seconds_sum {self.transfer_sum}\n"
            f"vllm:nixl_xfer_time_seconds_count {self.transfer_count}\n"
            f"vllm:nixl_bytes_transferred_sum {self.transfer_bytes}\n"
            f"vllm:request_decode_time_seconds_sum {self.decode_sum}\n"
            f"vllm:request_decode_time_seconds_count {self.decode_count}\n"
            f"vllm:request_generation_tokens_sum {self.generated}\n"
            f"vllm:iteration_tokens_total_count {self.steps}\n"
        )


@pytest.fixture
def fake(prefill_engine: StubEngine, decode_engine: StubEngine) -> FakeVllm:
    return FakeVllm(prefill_engine, decode_engine)


@pytest.fixture
def spec(write_spec, make_spec) -> ClusterSpec:
    return ClusterSpec.from_file(write_spec(make_spec(name="fake", connector="vllm-nixl")))


SMALL_GRID = ProfileGrid(
    prefill_tokens=(64, 256),
    prefill_batch=(1, 2),
    decode_batch=(1, 4),
    decode_context=(128, 512),
    transfer_tokens=(256, 1024),
    repeats=2,
    decode_tokens=8,
)


async def test_measured_profile_holds_the_engines_costs_and_loads_back(
    fake: FakeVllm, prefill_engine, decode_engine, make_proxy, spec, tmp_path: Path
):
    proxy = await make_proxy(request_timeout_s=10)
    endpoints = ClusterEndpoints("fake", "m", "vllm-nixl", proxy.url, prefill_engine.url, decode_engine.url, 31.5)
    fake.split_next = 1  # the first measured prefill took two passes: measured again
    progress: list[str] = []

    profile = await profiler.measure(spec, endpoints, SMALL_GRID, on_progress=progress.append, seed=1)
    profile.save(tmp_path / "fake.yaml")
    loaded = load_profile(tmp_path / "fake.yaml")

    assert loaded.name == "fake"
    assert loaded.prefill.rows == [64.0, 256.0] and loaded.prefill.cols == [1.0, 2.0]
    expected = [[round(prefill_pass_s(t, b), 5) for b in (1, 2)] for t in (64, 256)]
    assert loaded.prefill.seconds == expected
    measured = [r.body for r in prefill_engine.requests if not r.is_prefill]
    # warm-up, 4 points x 2 repeats, a blocker before each batch of 2, and the attempt answered late
    assert len(measured) == 1 + 8 + 4 + 1
    assert [len(p) for p in measured[-2]["prompt"]] == [256]  # the blocker: one sequence of the grid's largest pass
    assert [len(p) for p in measured[-1]["prompt"]] == [128, 128]
    prompts = [tuple(p) for body in measured[1:] for p in body["prompt"]]
    assert len(set(prompts)) == len(prompts) == 2 * (1 + 2 + 1) * 2 + 1  # fresh every time: no prefix cache hit
    assert loaded.decode.rows == [1.0, 4.0] and loaded.decode.cols == [128.0, 512.0]
    for i, batch in enumerate((1, 4)):
        for j, context in enumerate((128, 512)):
            assert loaded.decode.seconds[i][j] == pytest.approx(decode_step_s(batch, context), rel=0.3)
    assert loaded.decode.seconds[1][0] > 2 * loaded.decode.seconds[0][0]
    assert loaded.transfer.x == [256_000.0, 1_024_000.0]
    assert loaded.transfer.y == [round(transfer_s(256_000), 6), round(transfer_s(1_024_000), 6)]
    assert loaded.engine.kv_bytes_per_token == BYTES_PER_TOKEN
    assert loaded.engine.handoff_s == 0.0  # the stubs answer at once: nothing beyond the costs they report
    assert any(line.startswith("hand-off beyond the transfer") for line in progress)
    assert loaded.engine.kv_capacity_tokens == KV_CAPACITY
    assert (loaded.engine.max_num_seqs, loaded.engine.max_num_batched_tokens) == (128, 2048)
    assert loaded.engine.startup_s == 31.5
    assert "vllm:nixl_xfer_time_seconds" in loaded.provenance and "model 'm'" in loaded.provenance
    assert progress[0].startswith("prefill    64 tokens: batch 1 0.034s, batch 2 0.036s")
    assert len(progress) == 2 + 2 + 1 + 1


async def test_a_pass_answered_late_by_a_slow_front_end_is_still_one_pass(
    fake: FakeVllm, prefill_engine, decode_engine, make_proxy, spec
):
    """The engine's steps tell one pass, not the client's wall time: the front end's ~6 ms a prompt made every
    attempt at 8 prompts of 8 tokens read as two passes (a 74-ms pass answered in 121 ms) and the profile fail."""
    proxy = await make_proxy(request_timeout_s=10)
    endpoints = ClusterEndpoints("fake", "m", "vllm-nixl", proxy.url, prefill_engine.url, decode_engine.url, 1.0)
    fake.front_end_s = 2 * prefill_pass_s(256, 1)  # slower than any pass of the grid

    profile = await profiler.measure(spec, endpoints, SMALL_GRID)

    expected = [[round(prefill_pass_s(t, b), 5) for b in (1, 2)] for t in (64, 256)]
    assert [[round(x, 5) for x in row] for row in profile.prefill.seconds] == expected


async def test_prefill_that_never_shares_a_pass_fails_naming_the_engine(
    fake: FakeVllm, prefill_engine, decode_engine, make_proxy, spec
):
    proxy = await make_proxy(request_timeout_s=10)
    endpoints = ClusterEndpoints("fake", "m", "vllm-nixl", proxy.url, prefill_engine.url, decode_engine.url, 1.0)
    fake.split_next = 1000

    with pytest.raises(ProfilingError, match=rf"{prefill_engine.url}: 1 sequences of 64 tokens never shared one"):
        await profiler.measure(spec, endpoints, SMALL_GRID)
    attempts = profiler.ATTEMPTS_PER_REPEAT * SMALL_GRID.repeats
    assert len([r for r in prefill_engine.requests if not r.is_prefill]) == 1 + attempts


@pytest.mark.parametrize("stalled", [False, True])
async def test_the_decode_step_is_read_on_the_engines_clock_when_the_batch_prefilled_in_one_pass(
    fake: FakeVllm, decode_engine, stalled: bool
):
    """A front end (or client) descheduled for a whole decode hands the client every token at once: on the
    client's clock the step was ~0 (CI: the simulator's ITL of 0). The engine's clock is not fooled."""
    fake.stalled = stalled
    http = Http(aiohttp.ClientSession())
    try:
        prompts = RandomPrompts(list(range(100, 400)), seed=1)
        for batch in (1, 4):
            step = await profiler._decode_point(http, decode_engine.url, "m", prompts, batch, 128, SMALL_GRID)
            assert step == pytest.approx(decode_step_s(batch, 128), rel=0.3)
        blocker, batch_of_4 = [r.body for r in decode_engine.requests][-2:]  # the last repeat
        assert blocker["max_tokens"] == 1 and batch_of_4["max_tokens"] == SMALL_GRID.decode_tokens
        assert [len(p) for p in batch_of_4["prompt"]] == [128] * 4  # one request: its prompts reach the core together
    finally:
        await http.session.close()


async def test_a_batch_that_took_several_passes_is_read_on_the_clients_clock(
    fake: FakeVllm, decode_engine, caplog: pytest.LogCaptureFixture
):
    """Its first sequences decoded beside the others' prefill: the engine's decode time holds prefill passes."""
    fake.extra_steps = 1
    http = Http(aiohttp.ClientSession())
    try:
        prompts = RandomPrompts(list(range(100, 400)), seed=1)
        with caplog.at_level("INFO", logger=profiler.logger.name):
            step = await profiler._decode_point(http, decode_engine.url, "m", prompts, 4, 128, SMALL_GRID)
        assert step == pytest.approx(decode_step_s(4, 128), rel=0.3)
        assert "took 10 steps for 8 tokens each: on the client's clock" in caplog.text
    finally:
        await http.session.close()


async def test_a_run_neither_clock_can_read_is_made_again(
    fake: FakeVllm, decode_engine, caplog: pytest.LogCaptureFixture
):
    """Several passes (not the engine's clock) and every token read at the end (not the client's): on the CI
    machine the API server waits for the core its engine computes on. Measured again, then given up."""
    http = Http(aiohttp.ClientSession())
    try:
        prompts = RandomPrompts(list(range(100, 400)), seed=1)
        fake.unreadable_runs = 1
        with caplog.at_level("INFO", logger=profiler.logger.name):
            step = await profiler._decode_point(http, decode_engine.url, "m", prompts, 2, 128, SMALL_GRID)
        assert step == pytest.approx(decode_step_s(2, 128), rel=0.3)
        assert "read on neither clock: measured again" in caplog.text
        fake.unreadable_runs = 1000
        attempts = profiler.ATTEMPTS_PER_REPEAT * SMALL_GRID.repeats
        with pytest.raises(ProfilingError, match=f"read on neither clock in {attempts} runs") as failed:
            await profiler._decode_point(http, decode_engine.url, "m", prompts, 2, 128, SMALL_GRID)
        # What each run showed: a step more than one pass, and the tokens read together (1 ms for 12 tokens at
        # 20 ms a step would once have been taken for the step).
        runs = str(failed.value).split("(runs: ")[1].split(")")[0].split("; ")
        assert len(runs) == attempts and all(run.startswith("10 steps, 12 tokens in 0.00") for run in runs), runs
    finally:
        await http.session.close()


def test_decoding_span_only_while_every_stream_decodes():
    streams = [
        [(0.0, 1), (0.1, 2), (0.2, 3), (0.4, 5), (0.5, 6), (0.6, 7)],  # first token before the other's prompt
        [(0.3, 1), (0.5, 2), (0.7, 3)],
    ]
    # window [0.3, 0.6]: stream 0 from 0.4 (5 tokens) to 0.6 (7), stream 1 from 0.3 (1) to 0.5 (2)
    seconds, tokens = decoding_span(streams)
    assert (round(seconds, 6), tokens) == (0.4, 3)
    assert decoding_span([[(0.0, 1), (0.1, 2)], [(0.5, 1)]]) == (0.0, 0)  # never both decoding


def test_decoding_span_is_not_fooled_by_tokens_read_together():
    """A client descheduled for a while reads the tokens of several steps at once: their gaps are ~0, but the
    span over the window still gives the engine's step (on a loaded CI machine the median gap read 0.1 ms
    for an engine decoding at 115 ms a token)."""
    steps = [0.1 * i for i in range(8)]
    bunched = [(t if i in (0, 7) else 0.6 + 1e-4 * i, i + 1) for i, t in enumerate(steps)]  # steps 1-6 read at 0.6
    seconds, tokens = decoding_span([bunched])
    assert round(seconds / tokens, 6) == 0.1


def test_a_batch_of_several_passes_is_read_on_the_clients_clock_unless_read_together():
    """8 prompts of 512 tokens take two 2048-token passes on the CPU demo: the engine's decode time then holds the
    second pass, and half of it per token was more than the client's true step (55 ms): read on neither clock,
    every run. The client's chunks, a step apart, read it; chunks that came together do not."""
    streams = [[(1.0 + 0.055 * i, i + 1) for i in range(24)] for _ in range(8)]
    engine_with_a_pass = (8 * 23 * 0.055 + 4 * 5.0, 8 * 23)  # four sequences decoded through a 5-s pass
    run = DecodeRun(27, False, engine_with_a_pass, decoding_span(streams), read_together(streams))
    assert run.reading is not None and run.reading[0] / run.reading[1] == pytest.approx(0.055)
    bunched = [[(2.0 + 1e-5 * i, i + 1) for i in range(24)] for _ in range(8)]
    run = DecodeRun(27, False, engine_with_a_pass, decoding_span(bunched), read_together(bunched))
    assert run.reading is None
    assert read_together([[(0.0, 1)], []])  # a stream with no chunk: nothing to tell by


def test_handoff_is_what_ttft_spends_beyond_prefill_transfer_and_one_step():
    samples = [  # TTFT = 0.5 prefill + 0.05 transfer + 0.1 step + hand-off 0.2 / 0.3 / 0.25
        TransferSample(256, 0.05, 1e6, ttft_s=0.85, prefill_s=0.5),
        TransferSample(256, 0.05, 1e6, ttft_s=0.95, prefill_s=0.5),
        TransferSample(1024, 0.05, 4e6, ttft_s=0.90, prefill_s=0.5),
    ]
    assert handoff_seconds(samples, lambda tokens: 0.1) == pytest.approx(0.25)
    # A faster TTFT than its parts (clock skew, a descheduled scrape) never makes the hand-off negative.
    assert handoff_seconds([TransferSample(256, 0.05, 1e6, ttft_s=0.1, prefill_s=0.5)], lambda t: 0.1) == 0


def test_transfer_table_merges_equal_bytes_and_weighs_tokens():
    samples = [
        TransferSample(100, 0.010, 128_000),
        TransferSample(100, 0.012, 128_000),
        TransferSample(120, 0.011, 128_000),  # same block count as 100: same bytes, one point
        TransferSample(1024, 0.050, 1_024_000),
    ]
    nbytes, seconds, per_token = transfer_table(samples)
    assert nbytes == [128_000, 1_024_000]
    assert seconds == [0.011, 0.05]
    assert per_token == round((3 * 128_000 + 1_024_000) / (100 + 100 + 120 + 1024))
    with pytest.raises(ProfilingError, match="bytes counter did not grow"):
        transfer_table([TransferSample(256, 0.01, 0.0)])


def test_kv_capacity_from_cache_config_info():
    assert kv_capacity_tokens({"kv_cache_size_tokens": "23296", "block_size": "128"}, "u") == 23296
    assert kv_capacity_tokens({"kv_cache_size_tokens": "None", "num_gpu_blocks": "182",
                               "block_size": "128"}, "u") == 182 * 128  # fmt: skip
    with pytest.raises(ProfilingError, match=r"http://e:1/metrics: no vllm:cache_config_info"):
        kv_capacity_tokens(None, "http://e:1")


def test_batch_limits_from_spec_or_vllm_cpu_defaults(write_spec, make_spec):
    def limits(**overrides) -> tuple[int, int]:
        return batch_limits(ClusterSpec.from_file(write_spec(make_spec(**overrides))))

    assert limits() == (128, 2048)
    assert limits(prefill={"tensor_parallel_size": 2}) == (128, 4096)  # per rank, on the prefill pool
    assert limits(engine={"extra_args": {"max_num_seqs": 16, "max_num_batched_tokens": 512}}) == (16, 512)
    with pytest.raises(ProfilingError, match=r"engine.extra_args.max_num_seqs: must be set for device 'cuda'"):
        limits(device="cuda", resources={"gpus": 2})


def test_grid_check_names_the_option():
    check = dict(max_num_seqs=128, max_num_batched_tokens=2048, max_model_len=4096, disagg_from=0)
    DEFAULT_GRID.check(**check)
    QUICK_GRID.check(**check)
    with pytest.raises(ProfilingError, match=r"--prefill-tokens: 4096 exceeds the engines' max_num_batched_tokens"):
        ProfileGrid(prefill_tokens=(256, 4096)).check(**check)
    with pytest.raises(ProfilingError, match=r"--decode-batch: must be increasing"):
        ProfileGrid(decode_batch=(4, 2)).check(**check)
    with pytest.raises(ProfilingError, match=r"--transfer-tokens: 256 is below proxy.decode_only_below_tokens"):
        ProfileGrid().check(**(check | {"disagg_from": 512}))


def test_endpoints_from_status_need_a_ready_engine_of_each_role():
    def engine(engine_id: str, role: str, state: str, url: str, load_s: float | None) -> dict:
        return {"engine_id": engine_id, "role": role, "state": state, "url": url, "load_s": load_s}

    status = {"name": "c", "model": "m", "connector": "pdserve", "proxy_url": "http://p"}
    status["engines"] = [
        engine("prefill-0", "prefill", "starting", "", None),
        engine("prefill-1", "prefill", "ready", "http://p1", 30.0),
        engine("decode-0", "decode", "ready", "http://d0", 34.0),
    ]
    endpoints = ClusterEndpoints.from_status(status)
    assert (endpoints.prefill_url, endpoints.decode_url, endpoints.startup_s) == ("http://p1", "http://d0", 32.0)
    status["engines"][2]["state"] = "failed"
    with pytest.raises(ProfilingError, match=r"no ready decode engine \(prefill-0 starting, prefill-1 ready, "):
        ClusterEndpoints.from_status(status)


def test_cli_checks_the_grid_before_touching_any_cluster(local_cpu_spec, monkeypatch, capsys):
    from orchestrator import cluster

    monkeypatch.setattr(cluster, "status", lambda: pytest.fail("the cluster was asked for"))
    assert main(["profile", str(local_cpu_spec), "--prefill-tokens", "1024", "4096"]) == 1
    assert "--prefill-tokens: 4096 exceeds the engines' max_num_batched_tokens (2048)" in capsys.readouterr().err


def test_cli_refuses_a_running_cluster_of_another_spec(local_cpu_spec, monkeypatch, capsys):
    from orchestrator import cluster

    other = {"name": "other", "model": "smollm2-135m-instruct", "connector": "pdserve", "engines": []}
    monkeypatch.setattr(cluster, "status", lambda: other)
    monkeypatch.setattr(cluster, "down", lambda: pytest.fail("a cluster it did not start was stopped"))
    assert main(["profile", str(local_cpu_spec)]) == 1
    err = capsys.readouterr().err
    assert "the running cluster 'other' (model 'smollm2-135m-instruct', connector pdserve) is not the one" in err


async def test_a_request_through_the_proxy_is_read_on_whichever_engine_of_the_pool_served_it(make_engine) -> None:
    """With two prefill engines the proxy may pick either: the profiler reads the one whose count rose
    (it waited on the first engine's before, and failed: 'expected 147' on a two-prefill cluster)."""
    counts = {"prefill-0": 3, "prefill-1": 5}
    engines = [
        await make_engine(
            name, extra_metrics=lambda name=name: f"vllm:request_prefill_time_seconds_count {counts[name]}\n"
        )
        for name in counts
    ]
    status = {
        "name": "c", "model": "m", "connector": "pdserve", "proxy_url": "http://127.0.0.1:1",
        "engines": [{"engine_id": e.name, "role": "prefill", "state": "ready", "url": e.url} for e in engines]
        + [{"engine_id": "decode-0", "role": "decode", "state": "ready", "url": "http://127.0.0.1:2"}],
    }  # fmt: skip
    endpoints = ClusterEndpoints.from_status(status)
    assert endpoints.prefill_pool == tuple(e.url for e in engines) and endpoints.prefill_url == engines[0].url
    names = ("vllm:request_prefill_time_seconds_count",)
    http = Http(aiohttp.ClientSession())
    try:
        before = await http.pool_samples(endpoints.prefill_pool, names)
        counts["prefill-1"] += 1  # the proxy sent it to prefill-1
        assert await http.wait_for_one(before, names, names[0]) == {names[0]: 1.0}
    finally:
        await http.session.close()
