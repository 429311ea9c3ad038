"""``pdserve doctor`` beside the running shared cluster: with no spec named, it takes the cluster's, probes the
node through a Ray task pinned to it, finds the engines on one node, and measures their path there (a Ray task
that starts the two processes of ``orchestrator.doctor.measure`` on that node), the bytes read checked."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import Cluster, run_pdserve

pytestmark = [pytest.mark.integration, pytest.mark.parametrize("cluster", ["pdserve"], indirect=True)]


def test_doctor_beside_the_running_cluster_probes_and_measures_its_node(cluster: Cluster) -> None:
    result = run_pdserve("doctor", "--json", env=cluster.env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    ((host, probe),) = report["hosts"].items()  # one node: this machine, probed by a Ray task
    assert probe["nixl_build"] and "UCX" in probe["nixl_plugins"]
    (path,) = report["paths"]
    assert (path["host"], path["place"], path["memory"], path["transport"]) == (host, "same-node", "cpu", "nixl")
    assert path["ucx"][:2] == ["posix", "sysv"] and path["verdict"] != "broken", path
    measured = path["measurement"]
    assert measured["checked"] and measured["gbps"] > 0 and 60 <= measured["mib"] <= 64, measured
    print(f"pdserve doctor beside the cluster: {measured['gbps']:.2f} GB/s, "
          f"{100 * measured['share_of_copy']:.0f} % of a same-process copy")  # fmt: skip
