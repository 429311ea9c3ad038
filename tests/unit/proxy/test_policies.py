"""``proxy.policies``: one registry of routing policies, read by the config, the router and the simulator."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import pytest

from orchestrator.autoscale.simulator import SimOptions, Simulator
from proxy import policies
from proxy.config import POLICIES
from proxy.pool import EngineState
from testlib.profiles import TARGETS, Script, make_profile
from tests.unit.proxy_factories import proxy_config


class Newest:
    """A policy a newcomer adds: the last engine, always; the simulator has no model of it."""

    needs_load: ClassVar[bool] = False
    needs_prefix: ClassVar[bool] = False
    simulated_as: ClassVar[str | None] = None
    index = None

    @classmethod
    def from_config(cls, routing) -> Newest:
        return cls()

    def pick(self, engines: Sequence[EngineState], prefix: tuple[int, ...] = (), shared_depth: int = 0) -> EngineState:
        return engines[-1]

    choose = pick


@pytest.fixture
def newest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(policies.REGISTRY, "newest", Newest)


def test_the_config_offers_exactly_the_registry():
    assert POLICIES == tuple(policies.REGISTRY) == ("round_robin", "least_loaded", "prefix_aware")


@pytest.mark.parametrize("name", list(policies.REGISTRY))
def test_every_policy_says_what_it_needs_and_how_it_is_simulated(name):
    policy = policies.make_policy(name, proxy_config().routing)
    assert isinstance(policy.needs_load, bool) and isinstance(policy.needs_prefix, bool) and policy.summary
    assert policies.simulated_as(name) in ("in_turn", "least_loaded")
    assert (policy.index is not None) == policy.needs_prefix
    engines = tuple(EngineState(f"prefill-{i}", f"http://127.0.0.1:{8100 + i}", "prefill") for i in range(3))
    assert policy.pick(engines, (1, 2)) in engines and policy.choose(engines, (1, 2)) in engines


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        policies.make_policy("fastest", proxy_config().routing)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        policies.simulated_as("fastest")


def test_a_policy_added_to_the_registry_routes_and_the_simulator_refuses_it_by_name(newest):
    engines = tuple(EngineState(f"prefill-{i}", f"http://127.0.0.1:{8100 + i}", "prefill") for i in range(3))
    assert policies.make_policy("newest", proxy_config().routing).pick(engines).engine_id == "prefill-2"
    with pytest.raises(ValueError, match="does not model routing policy 'newest'"):
        Simulator(make_profile(), Script([(1, 1)]), TARGETS, (1, 1), SimOptions(routing=("newest", "least_loaded")))
