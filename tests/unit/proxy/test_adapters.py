"""LoRA adapters behind one endpoint: both pools load them (``engine.lora_adapters``), the proxy takes an
adapter's name as a model, lists it, indexes its prefixes apart from the base model's, and keeps its requests
on engines of its own when engines hold fewer adapters than the cluster serves.

The real path (vLLM CPU engines applying a random adapter, its answer through P/D equal to one engine alone and
unlike the base model's) is ``tests/integration/test_parity.py``.
"""

from __future__ import annotations

import orjson
import pytest

from contract import wire
from orchestrator.launch import plan_engines
from orchestrator.spec import ClusterSpec
from proxy.errors import ModelNotFound
from proxy.pool import Endpoint, EnginePool
from proxy.routing import Router, adapter_engines, prefix_hashes
from tests.unit.conftest import PROXY_MODEL, spec_dict
from tests.unit.proxy_factories import APIS, parse_request, proxy_config

COMPLETIONS, CHATS = APIS["completion"], APIS["chat"]

pytestmark = pytest.mark.timeout(15)

ADAPTERS = {"pirate": "/adapters/pirate", "poet": "/adapters/poet"}


def test_both_pools_load_the_adapters_and_the_proxy_serves_them():
    spec = ClusterSpec.model_validate(spec_dict(engine={"lora_adapters": ADAPTERS, "max_loras": 2}))
    for launch in plan_engines(spec):
        args = launch.vllm_args
        assert "--enable-lora" in args and args[args.index("--max-loras") + 1] == "2"
        modules = args[args.index("--lora-modules") + 1 : args.index("--lora-modules") + 3]
        assert modules == ["pirate=/adapters/pirate", "poet=/adapters/poet"]
    config = spec.proxy_config()
    assert (config.adapters, config.max_loras) == (("pirate", "poet"), 2)
    plain = ClusterSpec.model_validate(spec_dict())
    assert not any("--enable-lora" in launch.vllm_args for launch in plan_engines(plain))


def test_a_spec_names_its_adapters_plainly():
    with pytest.raises(ValueError, match="lora_adapters"):
        ClusterSpec.model_validate(spec_dict(engine={"lora_adapters": {"bad name!": "/x"}}))


def test_a_request_may_name_an_adapter_and_nothing_else():
    body = {"model": "pirate", "messages": [{"role": "user", "content": "Hi"}]}
    assert parse_request(orjson.dumps(body), "chat", PROXY_MODEL, ("pirate",))["model"] == "pirate"
    with pytest.raises(ModelNotFound) as refused:
        parse_request(orjson.dumps(body | {"model": "parrot"}), "chat", PROXY_MODEL, ("pirate",))
    assert refused.value.message == f"The model `parrot` does not exist; this server serves `{PROXY_MODEL}`, `pirate`"


def test_an_adapters_prefixes_are_not_the_base_models():
    prompt = {"prompt": "x" * 400}
    base = prefix_hashes({"model": PROXY_MODEL} | prompt, COMPLETIONS, 64, 4)
    adapted = prefix_hashes({"model": "pirate"} | prompt, COMPLETIONS, 64, 4)
    assert len(base) == len(adapted) == 4 and not set(base) & set(adapted)


def engines(pool: EnginePool, role: str, count: int) -> None:
    pool.set_endpoints(role, [Endpoint(f"{role}-{i}", f"http://127.0.0.1:{9000 + i}") for i in range(count)])


def test_each_adapter_keeps_its_share_of_the_pool_when_engines_hold_fewer_than_all():
    pool = EnginePool()
    engines(pool, "prefill", 4)
    engines(pool, "decode", 4)
    names = [f"adapter-{i}" for i in range(8)]
    router = Router(pool, proxy_config(PROXY_MODEL, adapters=tuple(names), max_loras=2))
    chosen = {}
    for name in names:
        routes = [router.route({"model": name, "prompt": f"request {n}"}, COMPLETIONS) for n in range(12)]
        chosen[name] = {r.decode.engine_id for r in routes}, {r.prefill.engine_id for r in routes}
    for decode, prefill in chosen.values():  # 4 engines x 2 adapters each / 8 adapters: one engine per adapter
        assert len(decode) == len(prefill) == 1
    assert len({next(iter(d)) for d, _ in chosen.values()}) > 1  # spread over the pool
    base = {router.route({"model": PROXY_MODEL, "prompt": f"r {n}"}, COMPLETIONS).decode.engine_id for n in range(8)}
    assert len(base) == 4  # the base model goes anywhere


def test_an_adapter_keeps_its_engines_while_the_pool_stays_and_moves_little_when_it_changes():
    pool = EnginePool()
    engines(pool, "decode", 6)
    ready = pool.ready("decode")
    before = {f"a{i}": adapter_engines(ready, f"a{i}", 1, 3) for i in range(30)}
    assert all(len(kept) == 2 for kept in before.values())  # 6 engines x 1 / 3 adapters
    assert before == {f"a{i}": adapter_engines(ready, f"a{i}", 1, 3) for i in range(30)}
    fewer = tuple(e for e in ready if e.engine_id != "decode-5")
    after = {name: adapter_engines(fewer, name, 1, 3) for name in before}
    untouched = [name for name, kept in before.items() if "decode-5" not in {e.engine_id for e in kept}]
    assert untouched and all(after[name] == before[name] for name in untouched)
    assert adapter_engines(ready, "a0", 3, 3) == ready  # engines hold every adapter: no restriction


async def test_models_lists_the_adapters_after_the_base_model(make_client):
    client = await make_client(adapters=("pirate", "poet"))
    listing = (await client.get(wire.MODELS_PATH)).json()
    assert [m["id"] for m in listing["data"]] == [PROXY_MODEL, "pirate", "poet"]
    assert [m.get("parent") for m in listing["data"]] == [None, PROXY_MODEL, PROXY_MODEL]
