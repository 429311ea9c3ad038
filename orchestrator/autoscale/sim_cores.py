"""How engines that share CPU cores slow each other in the simulator.

``CoreSharing`` is the ``Simulator``'s collaborator that knows each engine's cores (``cores``: by engine id,
``prefill-0`` ..., as ``orchestrator.launch`` pins them) and which neighbours are busy on them: it gives the
factor a prefill pass, a decode step or a start-up takes beside them (``SharedCore``'s slowdowns), keeps an
engine busy while its worker polls after its work (``SPIN_S``), and has the simulator re-time the decode steps
beside an engine that started or ended work. The simulator's module docstring says what is modelled.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from orchestrator.autoscale.sim_model import EPS, SPIN_END, Engine, EngineState, SharedCore, cores_id_of

if TYPE_CHECKING:
    from orchestrator.autoscale.simulator import Simulator

__all__ = ["SPIN_S", "CoreSharing"]

# vLLM's worker keeps polling its shared-memory queue for this long after its last message before it
# sleeps on a socket (``SpinCondition``'s ``busy_loop_s``, vllm.distributed.device_communicators.shm_broadcast):
# an engine that just finished a pass or step keeps its core busy this much longer.
SPIN_S = 1.0
_NO_CORES: frozenset[Any] = frozenset()


class CoreSharing:
    """The cores of one run's engines (``cores``; none: no engine shares) and how their sharing slows them."""

    def __init__(self, sim: Simulator, cores: dict[str, frozenset[Any]], spin_s: float, shared: SharedCore) -> None:
        self.sim = sim
        self.cores = cores
        self.spin_s = spin_s
        self.shared = shared

    def cores_of(self, engine: Engine) -> frozenset[Any]:
        return self.cores.get(cores_id_of(engine), _NO_CORES) if self.cores else _NO_CORES

    def share(
        self,
        engine: Engine,
        slowdown: float,
        beside_start: float = 1.0,
        host: float = 1.0,
        beside_decode: float | None = None,
    ) -> float:
        """How many times slower than alone ``engine`` works now: ``1 + (slowdown - 1) * n + (beside_decode - 1)
        * d + (beside_start - 1) * m`` on its most crowded core, ``n`` the other engines busy on it (one still
        polling, too: ``SPIN_S``), ``d`` of them decode engines where ``beside_decode`` is given, and ``m`` those
        starting on it; times ``host`` while an engine on none of its cores computes."""
        mine = self.cores_of(engine)
        if not mine:
            return 1.0
        sim = self.sim
        decoding = {id(e) for e in sim.decode} if beside_decode is not None else set()
        others = [e for e in itertools.chain(sim.prefill, sim.decode) if e is not engine]
        busy = [
            (self.cores_of(e), (beside_decode if id(e) in decoding else slowdown) - 1.0)
            for e in others
            if e.state not in (EngineState.STOPPED, EngineState.STARTING)
            and (not e.idle or e.spins_until > sim.now + EPS)
        ]
        starting = [self.cores_of(e) for e in others if e.state is EngineState.STARTING]
        elsewhere = host != 1.0 and any(not e.idle and not self.cores_of(e) & mine for e in others)
        return (host if elsewhere else 1.0) * max(
            1.0
            + sum(extra for theirs, extra in busy if core in theirs)
            + (beside_start - 1.0) * sum(1 for theirs in starting if core in theirs)
            for core in mine
        )

    def went_idle(self, engine: Engine) -> None:
        """``engine`` has no work left: its neighbours speed up once its worker stops polling."""
        if not self.cores_of(engine):
            return
        if self.spin_s <= 0:
            self.neighbours_changed(engine)
            return
        engine.spins_until = self.sim.now + self.spin_s
        self.sim.at(engine.spins_until, SPIN_END, (engine, engine.spins_until))

    def on_spin_end(self, payload: tuple[Engine, float]) -> None:
        engine, until = payload
        if engine.spins_until == until and engine.idle:  # not busy again since
            self.neighbours_changed(engine)

    def neighbours_changed(self, engine: Engine) -> None:
        """Re-time the decode steps of the engines sharing a core with ``engine`` (it started or ended work),
        and of every other engine on the host where an engine elsewhere slows them (``SharedCore.host_decode``)."""
        mine = self.cores_of(engine)
        if not mine:
            return
        everywhere = self.shared.host_decode != 1.0
        for other in self.sim.decode:
            if other is not engine and other.running and (everywhere or mine & self.cores_of(other)):
                self.sim.advance(other)
                self.sim.reschedule(other)
