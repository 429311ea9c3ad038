"""connectors/holder.py: the order of a step's lease events against the leases' ends."""

from __future__ import annotations

import time
from types import SimpleNamespace

from connectors.holder import LeaseHolder


def test_a_release_that_comes_after_the_lease_ended_is_late_and_the_lease_expired() -> None:
    holder = LeaseHolder("prefill", lease_ttl_s=0.01)
    transports = SimpleNamespace(poll_notifications=list)
    holder.hold("p-r1", (3, 4))
    time.sleep(0.05)  # the lease ends; no step polled since
    holder.releases_in.put("p-r1")  # the decode engine gave up on its READ after the lease's end

    assert holder.poll(transports) == {"p-r1"}
    stats = holder._leases.stats()
    assert (stats.expired, stats.released) == (1, 0)
