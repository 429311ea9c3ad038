"""Multi-turn conversations with the KV tier and without it, through the cluster, in one run.

``--conversations`` conversations of 6-10 turns (seeded) take turns one request at
a time: round *t* sends turn *t* of every conversation still going, so between two
turns of one conversation all the others run. Each user message is ~300 tokens
(``--user-sentences``) and each answer at most ``--max-tokens`` greedy tokens, so
histories grow to 2-3k tokens; the engines' KV caches are cut to ``--kv-blocks``
blocks (128 tokens each) so that vLLM's prefix cache alone cannot keep all the
conversations (it is on in every run). Three runs of the same conversations, each on a cluster of its own:

- ``no-tier``: ``--config`` without ``kv_tier``, run first and again last
  (``no-tier-again``): the machine's speed drifts over the half hour the runs take, and
  the reference is both, pooled, so that it brackets the tier runs in time;
- ``tier``: with ``kv_tier`` (a fresh shared directory);
- ``tier-restart``: with the tier, and the cluster stopped and started again (new
  engines: empty host memory and prefix caches) after each round in ``--restart-after``;
  every cluster of the run is given one cluster secret (the tier's entries are MAC'd
  under a key derived from it), so a restarted one loads what the one before stored.

- ``no-tier-guess``: as ``no-tier``, with the proxy's ``routing.kv_events`` off: routing guesses what an
  engine's prefix cache holds from what it sent the engine, where the other runs read the engines' KV events.

Each turn is streamed through the proxy; TTFT is the time to the first content
token, and the engine that computed its prompt says how much of it its prefix cache held (its
``vllm:prefix_cache_hits_total``, read before and after the turn: turns run one at a time). Reported per
run: TTFT p50/p90 of turns >= 2 and its ratio to the pooled no-tier runs, the share of later turns' prompts
(and of decode-only turns') the computing engine's prefix cache served,
and whether every answer is the same as in ``no-tier`` (greedy, so it must be).
Machine speed drifts: compare the ratios, measured in the same run. With
``--decode-only-if-cached`` every run's proxy serves a turn decode-only when the
decode engine can load most of it (the tier holds it; without the tier, the decode
engine was sent it), and each row says how the turn was served (``path``).

    python scripts/bench_multiturn.py [--conversations 6] [--out lab/results/multiturn-benchmark.json]
    python scripts/bench_multiturn.py --first-sentences 80 --user-sentences 8 --max-tokens 64   (chat over a document)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testlib.cluster_client import pdserve  # noqa: E402
from testlib.multiturn import CPU_BLOCK_TOKENS, conversations, down, stream_chat, up  # noqa: E402

REFERENCE_RUNS = ("no-tier", "no-tier-again")
"""The runs every other is compared with, pooled."""


def engine_urls() -> dict[str, str]:
    return {e["engine_id"]: e["url"] for e in json.loads(pdserve("status", "--json").stdout)["engines"]}


def cache_hits(url: str) -> float:
    """The engine's ``vllm:prefix_cache_hits_total``: prompt tokens its prefix cache served so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:prefix_cache_hits_total"))


def spec_file(
    config: str,
    workdir: Path,
    run: str,
    tier_dir: Path | None,
    kv_blocks: int,
    block_size: int,
    decode_only_if_cached: bool = False,
    kv_events: bool = True,
) -> str:
    raw = yaml.safe_load(Path(config).read_text())
    raw.pop("kv_tier", None)
    raw["name"] = f"multiturn-{run}"
    if decode_only_if_cached:  # in every run: without the tier, what the decode engine holds (or was sent) counts
        raw["proxy"] = {**raw.get("proxy", {}), "decode_only_if_cached": True}
    if not kv_events:
        proxy = raw.setdefault("proxy", {})
        proxy["routing"] = {**proxy.get("routing", {}), "kv_events": False}
    engine = raw.setdefault("engine", {})
    # the same KV cache in tokens whatever the block size
    blocks = kv_blocks * CPU_BLOCK_TOKENS // block_size
    engine["extra_args"] = {**engine.get("extra_args", {}), "num_gpu_blocks_override": blocks}
    if block_size != CPU_BLOCK_TOKENS:
        engine["extra_args"]["block_size"] = block_size
    if tier_dir is not None:
        raw["kv_tier"] = {"host_gib": 1, "shared_gib": 4, "shared_path": str(tier_dir)}
    path = workdir / f"{run}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def run(spec: str, talks: list[list[str]], max_tokens: int, restart_after: set[int]) -> list[dict]:
    """Every turn of every conversation, round by round; a row per turn."""
    rows: list[dict] = []
    histories: list[list[dict]] = [[] for _ in talks]
    proxy_url = up(spec)
    urls = engine_urls()
    try:
        for turn in range(max(len(t) for t in talks)):
            for c, talk in enumerate(talks):
                if turn >= len(talk):
                    continue
                histories[c].append({"role": "user", "content": talk[turn]})
                before = {engine: cache_hits(url) for engine, url in urls.items()}
                ttft, answer, prompt_tokens, path, engine = stream_chat(proxy_url, histories[c], max_tokens)
                cached = cache_hits(urls[engine]) - before[engine] if engine in urls else 0.0
                histories[c].append({"role": "assistant", "content": answer})
                row = {"conversation": c, "turn": turn + 1, "ttft_s": ttft, "prompt_tokens": prompt_tokens}
                rows.append(row | {"answer": answer, "path": path, "engine": engine, "cached_tokens": cached})
                print(
                    f"  conversation {c} turn {turn + 1}: {prompt_tokens} tokens, {cached:.0f} cached on {engine}, "
                    f"TTFT {ttft:.2f} s ({path})",
                    flush=True,
                )
            if turn + 1 in restart_after:
                print(f"  restarting the engines after round {turn + 1}", flush=True)
                down()
                proxy_url = up(spec)
                urls = engine_urls()
    finally:
        down()
    return rows


def _share(rows: list[dict]) -> float | None:
    """The prompt tokens the computing engines' prefix caches served, over those of ``rows``."""
    prompts = sum(r["prompt_tokens"] for r in rows)
    return sum(r.get("cached_tokens", 0) for r in rows) / prompts if prompts else None


def summary(rows: list[dict], baseline: list[dict] | None) -> dict:
    later = sorted(r["ttft_s"] for r in rows if r["turn"] >= 2)
    first = sorted(r["ttft_s"] for r in rows if r["turn"] == 1)
    out = {
        "turns": len(rows),
        "ttft_turn1_p50_s": statistics.median(first),
        "ttft_later_p50_s": statistics.median(later),
        "ttft_later_p90_s": later[int(0.9 * (len(later) - 1))],
        "max_prompt_tokens": max(r["prompt_tokens"] for r in rows),
        "decode_only_turns": sum(r.get("path", "").startswith("decode-only") for r in rows),
        # how much of its prompt the engine that computed a turn held: all turns >= 2, and those served decode-only
        # (routing believed the decode engine held most of it)
        "cached_share_later": _share([r for r in rows if r["turn"] >= 2]),
        "cached_share_decode_only": _share([r for r in rows if r.get("path", "").startswith("decode-only")]),
    }
    if baseline is not None:
        answers = {(r["conversation"], r["turn"]): r["answer"] for r in baseline}
        out["answers_identical"] = sum(answers.get((r["conversation"], r["turn"])) == r["answer"] for r in rows)
        out["answers_compared"] = len(rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local-cpu.yaml")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32, help="longest answer (greedy; most use all)")
    parser.add_argument("--user-sentences", type=int, default=22, help="sentences per user message (~13 tokens each)")
    parser.add_argument("--first-sentences", type=int, help="sentences of the first message (default: as others)")
    parser.add_argument(
        "--kv-blocks", type=int, default=40, help="KV cache per engine, in 128-token blocks (whatever --block-size)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=CPU_BLOCK_TOKENS,
        help="tokens per KV block (vLLM's --block-size) in every run: the tier stores full blocks only",
    )
    parser.add_argument(
        "--decode-only-if-cached",
        action="store_true",
        help="the proxy's decode_only_if_cached in every run: a turn whose history the tier holds (or, without "
        "the tier, that the decode engine was sent) goes to the decode engine alone",
    )
    parser.add_argument("--restart-after", default="1,4", help="rounds after which tier-restart restarts its engines")
    parser.add_argument("--runs", default="no-tier,tier,tier-restart,no-tier-again")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", help="also write the report (JSON) here")
    args = parser.parse_args()

    talks = conversations(args.conversations, args.seed, args.user_sentences, args.first_sentences)
    restart_after = {int(r) for r in args.restart_after.split(",") if r}
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-multiturn-"))
    os.environ.setdefault("PDSERVE_STATE_DIR", str(workdir / "state"))  # a cluster of this script's own
    # One cluster secret for every `pdserve up` of the run: the tier's MAC key is derived from it, so a
    # cluster started again (tier-restart) accepts what the one before it stored.
    from contract.auth import SECRET_ENV, SECRET_FILE_ENV, new_secret, write_secret

    if not (os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV)):
        write_secret(workdir / "cluster-secret", new_secret())
        os.environ[SECRET_FILE_ENV] = str(workdir / "cluster-secret")
    results: dict[str, dict] = {}
    rows_by_run: dict[str, list[dict]] = {}
    for name in args.runs.split(","):
        tier_dir = None if name.startswith("no-tier") else workdir / f"tier-{name}"
        spec = spec_file(
            args.config, workdir, name, tier_dir, args.kv_blocks, args.block_size, args.decode_only_if_cached,
            kv_events=not name.endswith("-guess"),
        )  # fmt: skip
        print(f"{name}:", flush=True)
        started, began = time.perf_counter(), time.strftime("%H:%M:%S")
        rows_by_run[name] = run(spec, talks, args.max_tokens, restart_after if name == "tier-restart" else set())
        results[name] = summary(rows_by_run[name], rows_by_run.get("no-tier") if name != "no-tier" else None)
        results[name]["began"] = began
        results[name]["wall_s"] = time.perf_counter() - started
    references = [rows for name, rows in rows_by_run.items() if name in REFERENCE_RUNS]
    base = summary([row for rows in references for row in rows], None) if references else None
    for name, result in results.items():
        if base is not None and name not in REFERENCE_RUNS:
            result["ttft_later_p50_ratio"] = result["ttft_later_p50_s"] / base["ttft_later_p50_s"]
            result["ttft_later_p90_ratio"] = result["ttft_later_p90_s"] / base["ttft_later_p90_s"]
    report = {
        "config": args.config,
        "conversations": args.conversations,
        "turns": [len(t) for t in talks],
        "max_tokens": args.max_tokens,
        "user_sentences": args.user_sentences,
        "first_sentences": args.first_sentences or args.user_sentences,
        "kv_blocks_per_engine": args.kv_blocks,
        "block_size": args.block_size,
        "decode_only_if_cached": args.decode_only_if_cached,
        "restart_after_rounds": sorted(restart_after),
        "seed": args.seed,
        "results": results,
        "reference": base,
        "rows": rows_by_run,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
