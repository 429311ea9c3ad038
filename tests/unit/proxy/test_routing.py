"""``proxy.routing``: the policies, prefix hashing, the token estimate and the router, without a network."""

from __future__ import annotations

import pytest

from proxy.errors import NoHealthyEngine
from proxy.policies import LeastLoaded, PrefixAware, PrefixIndex, RoundRobin
from proxy.pool import Endpoint, EnginePool, EngineState
from proxy.routing import (
    Router,
    TierHeld,
    prefix_hashes,
)
from tests.unit.proxy_factories import APIS, ROUTING_KEYS, proxy_config

COMPLETIONS, CHATS = APIS["completion"], APIS["chat"]

BLOCK = 8  # characters per prefix block in these tests


def engines(count: int, role: str = "prefill") -> tuple[EngineState, ...]:
    return tuple(EngineState(f"{role}-{i}", f"http://127.0.0.1:{8100 + i}", role) for i in range(count))


def completion(prompt: str | list) -> dict:
    return {"model": "m", "prompt": prompt}


def chat(*contents: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def hashes(prompt: str | list, max_blocks: int = 16) -> tuple[int, ...]:
    return prefix_hashes(completion(prompt), COMPLETIONS, BLOCK, max_blocks)


def make_router(prefill: int = 2, decode: int = 2, **settings) -> Router:
    pool = EnginePool()
    pool.set_endpoints("prefill", [e.endpoint for e in engines(prefill, "prefill")])
    pool.set_endpoints("decode", [e.endpoint for e in engines(decode, "decode")])
    return Router(pool, proxy_config(prefix_block_chars=BLOCK, **settings))


def picked(policy, pool: tuple[EngineState, ...], prefix: tuple[int, ...] = ()) -> str:
    return policy.pick(pool, prefix).engine_id


# --- round robin and least loaded -------------------------------------------------------


def test_round_robin_takes_turns():
    pool = engines(3)
    policy = RoundRobin()

    assert [picked(policy, pool) for _ in range(6)] == ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_least_loaded_counts_in_flight_and_the_engines_queue():
    pool = engines(3)
    pool[0].in_flight = 2
    pool[1].in_flight, pool[1].waiting = 0, 3  # idle here, but a queue at the engine
    pool[2].in_flight = 1

    assert picked(LeastLoaded(), pool) == "prefill-2"


def test_least_loaded_kv_cache_use_breaks_ties():
    pool = engines(2)
    pool[0].kv_cache_usage, pool[1].kv_cache_usage = 0.9, 0.1

    assert {picked(LeastLoaded(), pool) for _ in range(4)} == {"prefill-1"}


def test_least_loaded_spreads_equally_loaded_engines():
    pool = engines(3)
    policy = LeastLoaded()

    assert sorted(picked(policy, pool) for _ in range(3)) == ["prefill-0", "prefill-1", "prefill-2"]


def test_least_loaded_follows_the_load_as_legs_start():
    pool = engines(2)
    policy = LeastLoaded()
    for _ in range(4):
        policy.pick(pool).start_leg()

    assert [e.in_flight for e in pool] == [2, 2]


# --- prefix hashing ---------------------------------------------------------------------


def test_prompts_sharing_a_prefix_share_its_leading_hashes():
    shared = "s" * (3 * BLOCK)
    first, second = hashes(shared + "a" * BLOCK), hashes(shared + "b" * BLOCK)

    assert len(first) == len(second) == 4
    assert first[:3] == second[:3] and first[3] != second[3]


def test_a_hash_stands_for_the_whole_prefix_before_it():
    # The same second block after a different first block is a different prefix.
    assert hashes("a" * BLOCK + "c" * BLOCK)[1] != hashes("b" * BLOCK + "c" * BLOCK)[1]


def test_only_full_blocks_up_to_the_limit_are_hashed():
    assert hashes("x" * (BLOCK - 1)) == ()
    assert len(hashes("x" * (2 * BLOCK + 3))) == 2
    assert len(hashes("x" * (10 * BLOCK), max_blocks=4)) == 4


def test_token_prompts_are_cut_into_blocks_of_a_quarter_as_many_tokens():
    tokens = list(range(BLOCK))  # BLOCK / 4 tokens a block: 4 blocks

    assert len(hashes(tokens)) == 4
    assert hashes(tokens)[:2] == hashes(tokens[:4] + [99] * 4)[:2]


def test_a_batch_is_routed_by_its_first_prompt():
    assert hashes(["y" * BLOCK, "z" * BLOCK]) == hashes("y" * BLOCK)


def test_chats_sharing_a_system_prompt_share_a_prefix():
    system = "You are a helpful assistant. " * 4
    first = prefix_hashes(chat(system, "What is 2+2?"), CHATS, BLOCK, 64)
    second = prefix_hashes(chat(system, "Name a colour."), CHATS, BLOCK, 64)

    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert common >= len(system) // BLOCK


# --- the token estimate -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "kind", "tokens"),
    [
        (completion("x" * 40), "completion", 10),
        (completion("x" * 41), "completion", 11),
        (completion(list(range(7))), "completion", 7),
        (completion([[1, 2], [3, 4, 5]]), "completion", 5),
        (completion(["x" * 8, "y" * 4]), "completion", 3),
        (chat("x" * 20, "y" * 20), "chat", 10),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 8}]}]}, "chat", 2),
    ],
    ids=["text", "text-rounded-up", "token-ids", "token-batch", "text-batch", "chat", "chat-parts"],
)
def test_estimate_prompt_tokens(body, kind, tokens):
    assert APIS[kind].estimate_tokens(body) == tokens


def test_a_chat_with_an_image_counts_as_long():
    image = {"type": "image_url", "image_url": {"url": "data:..."}}
    body = {"model": "m", "messages": [{"role": "user", "content": [image]}]}

    assert CHATS.estimate_tokens(body) > 10**9


# --- prefix aware -----------------------------------------------------------------------


def test_prefix_aware_sends_a_prefix_back_to_the_same_engine():
    pool = engines(3)
    policy = PrefixAware(capacity=1000, overload_factor=2.0)
    system = "S" * (4 * BLOCK)

    first = picked(policy, pool, hashes(system + "question one"))
    again = [picked(policy, pool, hashes(system + f"question {i}" * 3)) for i in range(5)]

    assert again == [first] * 5


def test_prefix_aware_spreads_different_prefixes():
    pool = engines(3)
    policy = PrefixAware(capacity=1000, overload_factor=2.0)

    chosen = [picked(policy, pool, hashes(letter * (2 * BLOCK))) for letter in "abc"]

    assert sorted(chosen) == ["prefill-0", "prefill-1", "prefill-2"]
    assert [picked(policy, pool, hashes(letter * (2 * BLOCK))) for letter in "abc"] == chosen


def test_prefix_aware_prefers_the_longest_match():
    pool = engines(2)
    policy = PrefixAware(capacity=1000, overload_factor=10.0)
    shared = "s" * BLOCK
    short_holder = picked(policy, pool, hashes(shared))
    long_holder = next(e for e in pool if e.engine_id != short_holder)
    policy.index.record(hashes(shared + "t" * (2 * BLOCK)), long_holder.engine_id)

    assert picked(policy, pool, hashes(shared + "t" * (2 * BLOCK) + "u" * BLOCK)) == long_holder.engine_id


def test_prefix_aware_leaves_an_overloaded_holder_for_the_least_loaded():
    pool = engines(2)
    policy = PrefixAware(capacity=1000, overload_factor=2.0)
    prompt = hashes("p" * (3 * BLOCK))
    holder = policy.pick(pool, prompt)
    other = next(e for e in pool if e is not holder)

    holder.in_flight = 1  # (1 + 1) <= 2 x (0 + 1): still worth its cache
    assert policy.pick(pool, prompt) is holder
    holder.in_flight = 2  # (2 + 1) > 2 x (0 + 1): overloaded
    assert policy.pick(pool, prompt) is other
    holder.in_flight = 0  # the prefix now belongs to the other engine
    assert policy.pick(pool, prompt) is other


def test_prefix_aware_without_a_prefix_is_least_loaded():
    pool = engines(2)
    pool[0].in_flight = 3

    assert picked(PrefixAware(capacity=10, overload_factor=2.0), pool, ()) == "prefill-1"


def test_prefix_aware_ignores_engines_no_longer_ready():
    pool = engines(2)
    policy = PrefixAware(capacity=1000, overload_factor=2.0)
    prompt = hashes("q" * (2 * BLOCK))
    holder = policy.pick(pool, prompt)

    assert policy.pick(tuple(e for e in pool if e is not holder), prompt) is not holder


def test_prefix_index_forgets_the_least_recently_used_hashes():
    index = PrefixIndex(capacity=4)
    index.record((1, 2, 3), "a")
    index.record((4, 5), "b")

    assert len(index) == 4
    assert index.blocks_sent((1,), "a") == 0  # evicted
    assert index.blocks_sent((1, 2, 3), "a") == 3
    assert index.blocks_sent((4, 5), "b") == 2


# --- the router -------------------------------------------------------------------------


def test_router_disaggregates_by_default():
    prefill, decode, _, _ = make_router().route(completion("hi"), COMPLETIONS)

    assert prefill is not None and prefill.role == "prefill"
    assert decode.role == "decode"


def test_router_serves_short_prompts_decode_only():
    router = make_router(decode_only_below_tokens=10)

    short = router.route(completion("x" * 36), COMPLETIONS)  # 9 tokens
    long = router.route(completion("x" * 40), COMPLETIONS)  # 10 tokens

    assert short[0] is None and short[1].role == "decode"
    assert long[0] is not None


def test_router_decode_only_needs_no_prefill_engine():
    router = make_router(prefill=0, decode_only_below_tokens=100, degrade=False)

    assert router.route(completion("hi"), COMPLETIONS)[0] is None
    with pytest.raises(NoHealthyEngine, match="prefill"):
        router.route(completion("x" * 400), COMPLETIONS)


def test_without_prefill_engines_the_router_degrades_to_decode_only():
    route = make_router(prefill=0).route(completion("x" * 400), COMPLETIONS)
    assert route.prefill is None and route.decode.engine_id == "decode-0" and route.reason == "no-prefill-engine"


def test_without_decode_engines_a_prefill_engine_serves_the_request_whole():
    route = make_router(decode=0).route(completion("x" * 400), COMPLETIONS)
    assert route.prefill is None and route.decode.engine_id == "prefill-0" and route.reason == "no-decode-engine"


def test_with_no_engine_at_all_the_router_still_says_retry_later():
    with pytest.raises(NoHealthyEngine, match="prefill"):
        make_router(prefill=0, decode=0).route(completion("hi"), COMPLETIONS)


def test_router_decode_only_if_the_decode_engine_was_sent_the_prefix():
    router = make_router(decode=1, decode_only_if_cached=True)
    prompt = completion("r" * (5 * BLOCK))

    first = router.route(prompt, COMPLETIONS)
    second = router.route(prompt, COMPLETIONS)
    other = router.route(completion("o" * (5 * BLOCK)), COMPLETIONS)

    assert first[0] is not None  # nothing cached yet
    assert second[0] is None and second[1] is first[1]
    assert other[0] is not None


def test_router_decode_only_if_cached_with_a_prefix_aware_decode_pool():
    router = make_router(decode=3, decode_policy="prefix_aware", decode_only_if_cached=True)
    prompt = completion("r" * (5 * BLOCK))

    first = router.route(prompt, COMPLETIONS)
    second = router.route(prompt, COMPLETIONS)

    assert first[0] is not None
    assert second[0] is None and second[1] is first[1]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_router_retries_on_an_engine_not_tried(role):
    router = make_router(**{role: 3})
    prefill, decode, prefix, _ = router.route(completion("hi"), COMPLETIONS)
    first = prefill if role == "prefill" else decode
    tried = [first]

    second = router.retry(role, prefix, tried)
    tried.append(second)
    third = router.retry(role, prefix, tried)

    assert len({first.engine_id, second.engine_id, third.engine_id}) == 3
    assert {e.role for e in tried} == {role}
    assert router.retry(role, prefix, [*tried, third]) is None


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_router_with_an_empty_pool_says_retry_later(role):
    router = make_router(**{role: 0}, degrade=False)

    with pytest.raises(NoHealthyEngine) as caught:
        router.route(completion("hi"), COMPLETIONS)
    assert role in caught.value.message and caught.value.headers == {"Retry-After": "5"}


def test_router_skips_draining_and_ejected_engines():
    router = make_router(prefill=3)
    router.pool.drain("prefill-0")
    router.pool.set_healthy(router.pool.engine("prefill-1"), False)

    assert {router.route(completion("hi"), COMPLETIONS)[0].engine_id for _ in range(4)} == {"prefill-2"}


@pytest.mark.parametrize(
    "settings",
    [
        {"prefill_policy": "random"},
        {"decode_policy": ""},
        {"unhealthy_after": 0},
        {"healthy_after": 0},
        {"prefill_retries": -1},
        {"decode_only_below_tokens": -5},
        {"health_timeout_s": 0},
        {"prefix_overload_factor": 0.5},
        {"decode_only_cached_fraction": 0},
    ],
)
def test_routing_settings_refuse_impossible_values(settings):
    field = ROUTING_KEYS.get(next(iter(settings)), next(iter(settings)))
    with pytest.raises(ValueError, match=f"\n{field}\n"):
        proxy_config(**settings)


def test_only_load_aware_policies_need_metrics():
    assert not proxy_config().routing.needs_load
    assert proxy_config(decode_policy="least_loaded").routing.needs_load
    assert proxy_config(prefill_policy="prefix_aware").routing.needs_load


def test_router_accepts_plain_endpoints_in_its_pool():
    pool = EnginePool()
    pool.set_endpoints("prefill", [Endpoint("p", "http://p")])
    pool.set_endpoints("decode", [Endpoint("d", "http://d")])

    prefill, decode, _, _ = Router(pool, proxy_config()).route(chat("hi"), CHATS)
    assert (prefill.url, decode.url) == ("http://p", "http://d")


# --- a shared KV tier -------------------------------------------------------------------------


def test_with_a_shared_tier_any_decode_engine_serves_a_prompt_the_tier_holds_decode_only():
    router = make_router(decode=3, decode_policy="least_loaded", decode_only_if_cached=True, tier_pools=("decode",))
    prompt = completion("t" * (5 * BLOCK))  # never routed by this proxy

    stored = router.route(prompt, COMPLETIONS, TierHeld(320, 300))
    partly = router.route(completion("v" * (5 * BLOCK)), COMPLETIONS, TierHeld(320, 128))
    unknown = router.route(completion("w" * (5 * BLOCK)), COMPLETIONS, None)  # the tier engine did not answer

    assert stored.prefill is None and stored.reason == "cached"
    assert partly.prefill is not None and unknown.prefill is not None  # below decode_only_cached_fraction


def test_what_the_tier_holds_counts_only_for_the_tier_pools():
    decode_not_in_tier = make_router(decode_only_if_cached=True, tier_pools=("prefill",))
    no_tier = make_router(decode_only_if_cached=True)
    prompt = completion("t" * (5 * BLOCK))

    for router in (decode_not_in_tier, no_tier):
        assert router.route(prompt, COMPLETIONS, TierHeld(320, 320)).prefill is not None


def test_without_a_tier_only_the_engine_sent_the_prefix_counts_it_cached():
    router = make_router(decode=3, decode_policy="least_loaded", decode_only_if_cached=True)
    prompt = completion("t" * (5 * BLOCK))

    first = router.route(prompt, COMPLETIONS)
    first.decode.in_flight += 5
    second = router.route(prompt, COMPLETIONS)

    assert second.prefill is not None and second.decode is not first.decode


def test_prefix_aware_leaves_a_holder_whose_prefix_the_tier_holds_for_the_least_loaded():
    prompt = completion("s" * (6 * BLOCK))
    router = make_router(prefill=3, prefill_policy="prefix_aware", tier_pools=("prefill", "decode"))
    holder = router.route(prompt, COMPLETIONS).prefill
    holder.in_flight += 1  # a little busier than the others: not overloaded

    assert router.route(prompt, COMPLETIONS).prefill is holder  # the tier holds none of it: its cache is the copy
    assert router.route(prompt, COMPLETIONS, TierHeld(384, 384)).prefill is not holder  # all load it from the tier


def test_a_longer_prefix_on_one_engine_still_wins_over_the_tier():
    router = make_router(prefill=3, prefill_policy="prefix_aware", tier_pools=("prefill",))
    longer = completion("u" * (8 * BLOCK))
    holder = router.route(longer, COMPLETIONS).prefill  # one engine was sent 8 blocks
    holder.in_flight += 1

    assert router.route(longer, COMPLETIONS, TierHeld(512, 192)).prefill is holder  # the tier holds 3 of them


def test_tier_held_depth_is_its_share_of_the_prompt_in_the_proxys_blocks():
    body = completion("x" * (10 * BLOCK))  # 10 blocks; the engine counts the same prompt in its own tokens
    assert TierHeld(640, 320).depth(body, COMPLETIONS, BLOCK, 8) == 5
    assert TierHeld(640, 640).depth(body, COMPLETIONS, BLOCK, 8) == 8  # no deeper than the proxy hashed
    assert TierHeld(640, 0).depth(body, COMPLETIONS, BLOCK, 8) == 0
    assert TierHeld(0, 0).fraction == 0.0 and TierHeld(10, 20).fraction == 1.0


def test_routing_asks_the_tier_only_where_its_answer_changes_a_choice():
    long, short = completion("y" * (3 * BLOCK)), completion("hi")
    asks = make_router(decode_only_if_cached=True, tier_pools=("prefill", "decode"))

    assert asks.asks_tier(long, COMPLETIONS) and not asks.asks_tier(short, COMPLETIONS)
    assert not make_router(tier_pools=("prefill", "decode")).asks_tier(long, COMPLETIONS)  # round robin: no choice
    assert not make_router(decode_only_if_cached=True, kv_events=False).asks_tier(long, COMPLETIONS)  # no tier
    assert make_router(decode_only_if_cached=True).asks_tier(long, COMPLETIONS)  # its blocks, for the KV events
    assert not make_router().asks_tier(long, COMPLETIONS)  # round robin, no cache-aware choice: nothing to ask
    assert make_router(prefill_policy="prefix_aware", tier_pools=("prefill",)).asks_tier(long, COMPLETIONS)
    below = make_router(decode_only_if_cached=True, tier_pools=("decode",), decode_only_below_tokens=10_000)
    assert not below.asks_tier(long, COMPLETIONS)  # decode-only anyway


def test_the_tier_is_asked_of_its_pools_ready_engines_in_turn():
    router = make_router(prefill=2, decode=1, decode_only_if_cached=True, tier_pools=("prefill", "decode"))
    asked = [router.tier_engine().engine_id for _ in range(6)]
    assert asked == ["prefill-0", "prefill-1", "decode-0"] * 2
    assert make_router(prefill=0, decode=0, tier_pools=("decode",)).tier_engine() is None


def test_tier_pools_must_name_pools():
    with pytest.raises(ValueError, match="tier_pools"):
        proxy_config(tier_pools=("router",))


# --- what each engine's prefix cache holds, from its KV events (proxy.residency) ---------------------------


def follows(router: Router, holdings: dict[str, list[int]]) -> None:
    """The router's index follows every engine of ``holdings``, each holding those blocks."""
    for engine_id, blocks in holdings.items():
        router.residency.begin(engine_id, "e1")
        router.residency.apply(engine_id, {"seq": 0, "stored": blocks, "removed": [], "cleared": False})


def test_prefix_aware_goes_where_the_prefix_cache_holds_the_prompt_not_where_it_was_sent():
    router = make_router(prefill=3, prefill_policy="prefix_aware")
    prompt = completion("p" * (8 * BLOCK))
    sent_to = router.route(prompt, COMPLETIONS).prefill.engine_id  # the guess: the engine last sent it
    holder = next(e for e in ("prefill-0", "prefill-1", "prefill-2") if e != sent_to)
    follows(router, {sent_to: [], holder: [11, 12, 13, 14]})  # the engine it was sent evicted it; another holds it

    assert router.route(prompt, COMPLETIONS, TierHeld(64, 0, (11, 12, 13, 14))).prefill.engine_id == holder
    # without the prompt's blocks (the engine asked did not hash it), the guess stands: the engine last sent it
    assert router.route(prompt, COMPLETIONS, TierHeld(64, 0)).prefill.engine_id == holder


def test_without_kv_events_routing_keeps_the_sent_prefix_guess():
    router = make_router(prefill=3, prefill_policy="prefix_aware")
    prompt = completion("q" * (8 * BLOCK))
    sent_to = router.route(prompt, COMPLETIONS).prefill.engine_id
    assert not router.residency.following()  # no engine's stream is up
    assert router.route(prompt, COMPLETIONS, TierHeld(64, 0, (11, 12))).prefill.engine_id == sent_to
    assert make_router(prefill_policy="prefix_aware", kv_events=False).residency is None


def test_decode_only_if_cached_reads_what_the_decode_engine_holds():
    router = make_router(decode=1, decode_only_if_cached=True)
    prompt = completion("r" * (8 * BLOCK))
    follows(router, {"decode-0": [21, 22, 23, 24]})

    whole = router.route(prompt, COMPLETIONS, TierHeld(64, 0, (21, 22, 23, 24)))
    assert whole.prefill is None and whole.reason == "cached"
    router.residency.apply("decode-0", {"seq": 1, "stored": [], "removed": [22], "cleared": False})  # evicted
    partly = router.route(prompt, COMPLETIONS, TierHeld(64, 0, (21, 22, 23, 24)))
    assert partly.prefill is not None  # a quarter held: the prefill engine computes it
