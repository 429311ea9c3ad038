"""Scheduler side of the pdserve connector (pull mode): which tokens to load, which blocks to keep.

A request's life, seen from here:

- Prefill engine: the proxy sends ``kv_transfer_params={"do_remote_decode": true}``
  and ``max_tokens=1``. When the request finishes, ``request_finished`` keeps
  its blocks (vLLM must not free them) and answers the ``kv_transfer_params``
  the decode engine needs: this engine's id and side channel, the block ids,
  the number of computed tokens. The next ``build_connector_meta`` tells the
  worker to hold those blocks under a lease; the worker reports them as
  "finished sending" once read (or expired), and only then vLLM frees them.
- Decode engine: the proxy passes those params on with ``do_remote_prefill``.
  ``get_num_new_matched_tokens`` claims every prompt token not computed
  locally as loadable asynchronously, so the engine computes no prompt token;
  ``update_state_after_alloc`` pairs the freshly allocated local blocks with
  the remote ones, position by position (local block i with remote blocks
  [i*ratio, (i+1)*ratio) when the prefill's block size is ``ratio`` times
  smaller; a prefill block size that does not divide ours is computed here
  instead); ``build_connector_meta`` hands the pairs to the worker, which
  posts the READs. The worker's report of the load
  (``update_connector_output``) comes back to the client in the finished
  request's ``kv_transfer_params["pdserve_kv"]``.
- Blocks nobody will read are released at once, not at lease expiry: the
  proxy sends the ``pdserve_release`` message of the prefill's params when
  the client goes away; this side sends it when the decode engine needs no
  read (its prefix cache held the whole prompt) or the request ended before
  it was scheduled.
- A load whose READ may still land after it ended (aborted, never confirmed
  drained: ``connectors.reads``) comes back in the worker's metadata as
  quarantined: its blocks get a reference of ours that is never given back, so
  vLLM's pool never hands them to another request (nor to this one's
  recompute), and ``pdserve:kv_quarantined_blocks_total`` counts them.
- A stream's client learns how its KV got here too: the prefill's params carry
  a ``pdserve_report`` message that the proxy sends to the decode engine's
  side channel when the stream starts (``side_channel.RecentReports``).
- A request for ``n`` samples reaches the decode engine as ``n`` requests of one parent
  (``{i}_{parent}``, vLLM's fan-out) with the same parameters. The first one scheduled reads the KV; its
  siblings wait for that read, and then find the prompt in vLLM's prefix cache. Its parameters are not a
  replay for them, and they report the reader's load.
- Trust (``contract.auth``): the prefill side MACs what it issues (with the
  lease's end, and the decode engine the proxy named); the decode side acts on
  parameters only if their MAC holds, they have not expired, they name this
  engine (when they name one) and it has not used them before. Anything else
  is refused before any connection is made: the prompt is computed here,
  nothing is released anywhere, and ``pdserve:kv_refused_total{kind="params"}``
  counts it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.identity import engine_epoch
from connectors.log_limit import LogLimiter
from connectors.metadata import KVTransferParams, PdserveConnectorMetadata, ReceiveSpec
from connectors.options import ConnectorSettings
from connectors.side_client import ReleaseSender
from connectors.side_messages import release_message, report_key, report_message
from connectors.stats import PdserveKVStats, PdserveWorkerMeta
from contract import wire
from contract.auth import EXPIRED_REASON, ConsumedParams, KVAuth, Unauthenticated
from contract.kv_report import KVReport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PdserveScheduler"]

logger = logging.getLogger(__name__)


class PdserveScheduler:
    """The scheduler-side half of ``PdserveConnector``; one per engine, driven by vLLM's scheduler thread."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = ConnectorSettings.from_extra_config(extra, engine_id)
        self.side_channel_host, self.side_channel_port = settings.side_channel_host, settings.side_channel_port
        self.engine_id = engine_id
        self.lease_ttl_s = settings.lease_ttl_s
        self._auth = KVAuth.from_env()
        self.epoch = engine_epoch()
        self._consumed = ConsumedParams()
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        # One record per decode request that asked to load, from its first sight until request_finished.
        self._decode: dict[str, _DecodeRecord] = {}
        # One step's work for the workers, handed over and emptied by build_connector_meta.
        self._to_receive: dict[str, ReceiveSpec] = {}
        self._to_hold: dict[str, tuple[int, ...]] = {}
        self._to_report: dict[str, KVReport] = {}  # report_key -> a load decided here
        self._claimed_by: OrderedDict[str, str] = OrderedDict()  # MAC of params acted on -> the request (bounded)
        self._stats = PdserveKVStats()
        self._releases = ReleaseSender(engine_id, self._auth)
        self._refusals = LogLimiter(logger)
        self.quarantined_blocks = 0
        """Blocks kept out of vLLM's pool for good since the engine started (``_quarantine``)."""

    # ------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._remote_prefill_params(request)
        record = self._decode.get(request.request_id)
        if record is not None and record.reader is not None:
            # Until its sibling's read ends, ask again at the next step (None); then vLLM's prefix cache has it.
            reader = self._decode.get(record.reader)
            return (None, False) if reader is not None and reader.loading_tokens else (0, False)
        if params is None or self._block_ratio(params) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = self._remote_prefill_params(request)
        if params is None:
            return
        # From here the load (or the release of a load not needed) is the plan's: request_finished releases nothing.
        self._decode[request.request_id].planned = True
        try:
            # One transfer per request: vLLM may call this again once the load is done.
            request.kv_transfer_params[wire.DO_REMOTE_PREFILL] = False
            self._plan_read(request, params, blocks, num_external_tokens)
        except Exception as e:  # noqa: BLE001 - vLLM's engine core dies of anything raised here
            # The request waits for a load we promised: the worker fails it, and vLLM recomputes the prompt.
            logger.exception("request %s on engine %s: cannot plan its KV read", request.request_id, self.engine_id)
            self._to_receive[request.request_id] = ReceiveSpec(
                request_id=request.request_id,
                local_block_ids=(),
                remote=params,
                remote_block_ids=(),
                failure=f"{type(e).__name__}: {e}",
            )

    def _plan_read(
        self, request: Request, params: KVTransferParams, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        ratio = self._block_ratio(params)
        if ratio is None:
            logger.warning(
                "request %s on engine %s: block size %d of engine %s does not divide ours (%d); "
                "computing the prompt here and releasing its blocks",
                request.request_id,
                self.engine_id,
                params.block_size,
                params.remote_engine_id,
                self.block_size,
            )
            self._stats.record_failure("incompatible")
            detail = f"prefill block size {params.block_size}, decode block size {self.block_size}"
            self._report(request, params, KVReport.recomputed("incompatible", detail, params.remote_engine_id))
            self._release(params)
            return
        if num_external_tokens == 0:
            logger.info(
                "request %s on engine %s: nothing to load from engine %s (local prefix hit); releasing its blocks",
                request.request_id,
                self.engine_id,
                params.remote_engine_id,
            )
            self._report(request, params, KVReport("local_prefix_cache", bytes=0, transfer_ms=0.0))
            self._release(params)
            return
        if len(blocks.blocks) != 1:
            raise ValueError(f"request {request.request_id}: {len(blocks.blocks)} KV cache groups; only 1 is supported")
        # Local and remote block lists both start at the prompt's first token, so
        # local position i holds the tokens of remote positions [i*ratio, (i+1)*ratio);
        # hashed local blocks are prefix-cache hits that need no read.
        local_ids: list[int] = []
        remote_ids: list[int] = []
        loading: list[Any] = []
        for position, block in enumerate(blocks.blocks[0]):
            first = position * ratio
            if first >= len(params.remote_block_ids):
                break
            if block.block_hash is None and not block.is_null:
                local_ids.append(block.block_id)
                loading.append(block)
                remote_ids.extend(params.remote_block_ids[first : first + ratio])
        record = self._decode[request.request_id]
        record.loading_tokens, record.loading_blocks = num_external_tokens, tuple(loading)
        self._to_receive[request.request_id] = ReceiveSpec(
            request_id=request.request_id,
            local_block_ids=tuple(local_ids),
            remote=params,
            remote_block_ids=tuple(remote_ids),
        )
        logger.debug(
            "request %s on engine %s: will read %d blocks (%d tokens) from engine %s",
            request.request_id,
            self.engine_id,
            len(local_ids),
            num_external_tokens,
            params.remote_engine_id,
        )

    def _report(self, request: Request, params: KVTransferParams, report: KVReport) -> None:
        """A load decided here, not by the workers: for the finished request's ``kv_transfer_params``, and
        through the next metadata to the workers, whose side channel answers the proxy's query for a stream."""
        self._decode[request.request_id].report = report
        self._to_report[report_key(params.remote_engine_id, params.remote_request_id)] = report

    def _remote_prefill_params(self, request: Request) -> KVTransferParams | None:
        """The request's remote-prefill parameters if they ask to load, are well-formed and hold up; checked
        once per request, when its record is made (the worker checks their lease again when it reads)."""
        record = self._decode.get(request.request_id)
        if record is not None:
            return None if record.planned else record.params  # planned: loaded once, never again (preemption)
        if not wire.asks_remote_prefill(request.kv_transfer_params):
            return None
        record = self._decode[request.request_id] = _DecodeRecord()
        raw = request.kv_transfer_params
        try:
            params = wire.parse_remote_prefill(raw)
            self._auth.check_params(raw, self.engine_id)
            mac = str(raw.get(wire.PDSERVE_MAC))
            if not self._consumed.claim(raw):
                claimer, parent = self._claimed_by.get(mac), _parent(request.request_id)
                if claimer is not None and parent is not None and _parent(claimer) == parent:
                    if (reader := self._decode.get(claimer)) is not None:  # else it ended: vLLM's cache has it
                        record.reader = claimer
                        reader.siblings += 1
                    return None
                raise Unauthenticated("params", "already used (a replay)")
            self._claimed_by[mac] = request.request_id
            while len(self._claimed_by) > CLAIMS_KEPT:
                self._claimed_by.popitem(last=False)
        except wire.InvalidTransferParams as e:
            self._refuse(request, record, "malformed_params", str(e))
            return None
        except Unauthenticated as e:
            self._refuse(request, record, "params", e.reason)
            return None
        record.params = params
        return params

    def _refuse(self, request: Request, record: _DecodeRecord, kind: str, reason_text: str) -> None:
        """Refuse a request's parameters: it is computed here, nothing is released anywhere, it is counted."""
        self._stats.record_refused(kind)
        self._refusals.warning(
            kind,
            "request %s on engine %s: refused kv_transfer_params, computing the prompt here: %s",
            request.request_id,
            self.engine_id,
            reason_text,
        )
        reason = "malformed" if kind == "malformed_params" else "unauthenticated"
        if kind == "params" and reason_text.startswith(EXPIRED_REASON):
            reason = "expired"  # genuine, but the prefill's lease on their blocks is over
        record.report = KVReport.recomputed(reason)

    def _block_ratio(self, params: KVTransferParams) -> int | None:
        """Remote blocks per local block; None when the prefill's block size does not divide ours."""
        remote = params.block_size or self.block_size
        if remote > self.block_size or self.block_size % remote:
            return None
        return self.block_size // remote

    def _release(self, params: KVTransferParams) -> None:
        for rank in range(params.tp_size):
            self._releases.release(params.side_channel(rank), params.remote_request_id)

    # ------------------------------------------------------------ every step

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, PdserveWorkerMeta):
            # vLLM merges the ranks' reports of one step; ranks whose reads end in different steps
            # report in different steps, and their parts add up here.
            for request_id, report in meta.reports.items():
                if (record := self._decode.get(request_id)) is not None:
                    record.report = report if record.report is None else record.report.merge(report)
            for request_id in meta.quarantined:
                if (record := self._decode.get(request_id)) is not None:
                    self._quarantine(request_id, record)
        for request_id in output.failed_recving or ():
            if (record := self._decode.get(request_id)) is not None:
                self._stats.record_recomputed(record.loading_tokens)
                record.loading_tokens = 0
        for request_id in output.finished_recving or ():
            if (record := self._decode.get(request_id)) is not None:
                record.loading_tokens, record.loading_blocks = 0, ()

    def _quarantine(self, request_id: str, record: _DecodeRecord) -> None:
        """Keep the blocks a READ may still land in out of vLLM's pool for good: one more reference each, never
        given back (vLLM returns a block to its free queue only when no reference is left)."""
        blocks, record.loading_blocks = record.loading_blocks, ()
        for block in blocks:
            block.ref_cnt += 1
        self.quarantined_blocks += len(blocks)
        self._stats.record_quarantined(len(blocks))
        logger.error(
            "request %s on engine %s: %d KV blocks quarantined (a READ into them may still land); %d in all",
            request_id,
            self.engine_id,
            len(blocks),
            self.quarantined_blocks,
        )

    def take_stats(self) -> PdserveKVStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, PdserveKVStats()
        return stats

    def shutdown(self) -> None:
        self._releases.close()

    def build_connector_meta(self) -> PdserveConnectorMetadata:
        meta = PdserveConnectorMetadata(
            reqs_to_receive=list(self._to_receive.values()), reqs_to_hold=self._to_hold, reports=self._to_report
        )
        self._to_receive, self._to_hold, self._to_report = {}, {}, {}
        return meta

    # ------------------------------------------------------------ prefill side

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not wire.asks_remote_decode(params):
            return False, self._decode_finished(request)
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            logger.info(
                "request %s on engine %s ended as %s; its blocks are freed, not offered to a decode engine",
                request.request_id,
                self.engine_id,
                request.status.name,
            )
            return False, None
        if not block_ids:
            return False, None
        issued = {
            wire.DO_REMOTE_PREFILL: True,
            wire.DO_REMOTE_DECODE: False,
            wire.REMOTE_ENGINE_ID: self.engine_id,
            wire.REMOTE_REQUEST_ID: request.request_id,
            wire.REMOTE_HOST: self.side_channel_host,
            wire.REMOTE_PORT: self.side_channel_port,
            wire.REMOTE_BLOCK_IDS: list(block_ids),
            wire.REMOTE_NUM_TOKENS: request.num_computed_tokens,
            wire.TP_SIZE: self.tp_size,
            wire.BLOCK_SIZE: self.block_size,
            wire.PDSERVE_EPOCH: self.epoch,  # this start of the engine: a reader never reads another's mapping
            # For the proxy: send `message` to each endpoint if no decode engine will read these blocks.
            wire.PDSERVE_RELEASE: {
                "endpoints": list(
                    wire.side_channel_endpoints(self.side_channel_host, self.side_channel_port, self.tp_size)
                ),
                "message": release_message(self._auth, request.request_id, self.lease_ttl_s).decode(),
            },
            # For the proxy: send `message` to each rank of the decode engine when its stream starts; the
            # answer is how that rank loaded this KV (a stream has no kv_transfer_params for it).
            wire.PDSERVE_REPORT: {
                "message": report_message(self._auth, self.engine_id, request.request_id, self.lease_ttl_s).decode()
            },
        }
        if (reader := wire.reader_named(params)) is not None:
            issued[wire.PDSERVE_READER] = reader  # only that decode engine may act on these
        signed = self._auth.sign_params(issued, self.lease_ttl_s)
        # Last: once the worker is told to hold them, vLLM must not free these blocks (True below).
        self._to_hold[request.request_id] = tuple(block_ids)
        logger.debug(
            "request %s on engine %s: keeping %d blocks for a decode engine",
            request.request_id,
            self.engine_id,
            len(block_ids),
        )
        return True, signed

    def _decode_finished(self, request: Request) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` a finished decode request returns (how its prompt KV got here); its record
        ends here, and a load neither planned nor done releases the prefill's blocks."""
        record = self._decode.pop(request.request_id, None)
        if record is None:
            return None  # no P/D for this request
        if record.reader is not None:
            reader = self._decode.get(record.reader)
            if reader is not None:
                reader.siblings -= 1
                record.report = reader.report
        elif record.siblings:
            for sibling in self._decode.values():
                if sibling.reader == request.request_id:
                    sibling.report, sibling.reader = record.report, None
        elif record.report is None and record.params is not None and not record.planned:
            # It ended before it was ever scheduled here (aborted, or refused at allocation).
            logger.info(
                "request %s on engine %s ended before loading its KV; releasing its blocks on engine %s",
                request.request_id,
                self.engine_id,
                record.params.remote_engine_id,
            )
            self._release(record.params)
            record.report = KVReport("none", reason="finished before loading")
        return {wire.PDSERVE_KV: record.report.as_dict()} if record.report is not None else None


@dataclass(slots=True)
class _DecodeRecord:
    """A decode request that asked to load remote KV, from its first sight until ``request_finished``."""

    params: KVTransferParams | None = None
    """Its checked parameters; None when they were refused, or it is a sample reading through ``reader``."""
    reader: str | None = None
    """A sample of an n>1 request: its sibling that reads the KV."""
    siblings: int = 0
    """How many samples wait on this one's read."""
    planned: bool = False
    """The load was planned (a READ, or a release of what needs none): the worker or the plan releases."""
    loading_tokens: int = 0
    """Tokens a READ in flight loads (0 when none is)."""
    loading_blocks: tuple[Any, ...] = ()
    """vLLM's blocks (``KVCacheBlock``) that READ lands in, until it ends: quarantined if it never drains."""
    report: KVReport | None = None
    """How the prompt's KV got here."""


CLAIMS_KEPT = 4096  # which request claimed the parameters acted on last: enough to tell siblings from replays


def _parent(request_id: str) -> str | None:
    """The parent request of a sample of an n>1 request, which vLLM names ``{index}_{parent request id}``."""
    index, sep, parent = request_id.partition("_")
    return parent if sep and index.isdigit() else None
