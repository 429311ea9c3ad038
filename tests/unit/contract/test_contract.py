"""contract: the package below the three others, and its one KVReport with its one merge."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.kv_report import KVReport

ROOT = Path(__file__).resolve().parents[3]
PROJECT_PACKAGES = ("connectors", "orchestrator", "proxy", "lab", "scripts", "tests")


def imported_packages(package: str) -> dict[str, set[str]]:
    """The project packages each module of ``package`` imports (its own left out), by module path."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
        found[str(path.relative_to(ROOT))] = imported & set(PROJECT_PACKAGES) - {package}
    return found


@pytest.mark.parametrize(
    ("package", "allowed"), [("contract", set()), ("connectors", {"contract"}), ("proxy", {"contract"})]
)
def test_imports_go_one_way(package: str, allowed: set[str]):
    """The contract imports nothing of the project; the connectors and the proxy only the contract."""
    offenders = {module: found - allowed for module, found in imported_packages(package).items() if found - allowed}
    assert not offenders, offenders


def test_the_contract_imports_no_other_project_package_nor_vllm_ray_or_zmq():
    code = "import sys, contract.wire, contract.auth, contract.kv_report, contract.headers, contract.private_files\n"
    code += "import contract.framing\n"
    code += "bad = [m for m in ('vllm', 'ray', 'zmq', 'torch', 'connectors', 'proxy', 'orchestrator')"
    code += " if m in sys.modules]\n"
    subprocess.run([sys.executable, "-c", code + "assert not bad, bad"], check=True, cwd=ROOT)


def test_no_package_writes_a_header_name_of_its_own():
    """Header names are written once, in contract.headers; tests and docs say them as a client sees them."""
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in ("connectors", "orchestrator", "proxy", "lab", "scripts")
        for path in (ROOT / package).rglob("*.py")
        if "tests" not in path.relative_to(ROOT).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ('"X-PDServe-' in line or "'X-PDServe-" in line or '"x-pdserve-' in line) and "#" not in line.split('"')[0]
    ]
    assert not offenders, offenders


TRANSFER = KVReport.transfer(1000, 2.0, "nixl", "prefill-0", [0])


def test_ranks_of_one_load_add_up_and_the_slowest_counts():
    merged = TRANSFER.merge(KVReport.transfer(3000, 3.5, "nixl", "prefill-0", [1]))
    assert merged == KVReport.transfer(4000, 3.5, "nixl", "prefill-0", [0, 1])
    assert merged.header() == "source=transfer; bytes=4000; transfer_ms=3.5; transport=nixl; remote_engine_id=prefill-0"


def test_a_recompute_wins_with_its_reason_whichever_rank_says_it():
    failed = KVReport.recomputed("transport", "KV read failed: peer gone", "prefill-0")
    for merged in (TRANSFER.merge(failed), failed.merge(TRANSFER)):
        assert merged.source == "recomputed" and merged.reason == "transport"
        assert merged.bytes == 1000  # what was read before the failure still counts
        assert merged.detail == "KV read failed: peer gone"


def test_a_recompute_that_read_nothing_says_no_bytes():
    both = KVReport.recomputed("injected").merge(KVReport.recomputed("injected", remote_engine_id="prefill-0"))
    assert both.as_dict() == {"source": "recomputed", "reason": "injected", "remote_engine_id": "prefill-0"}
    assert both.header() == "source=recomputed; reason=injected; remote_engine_id=prefill-0"


def test_a_local_prefix_hit_says_zero_bytes():
    assert KVReport("local_prefix_cache", bytes=0, transfer_ms=0.0).header() == (
        "source=local_prefix_cache; bytes=0; transfer_ms=0.0"
    )


@pytest.mark.parametrize(
    "sent", [None, [], "transfer", {}, {"source": ""}, {"source": 3}, {"source": "transfer", "bytes": "many"}]
)
def test_what_is_not_a_report_reads_as_none(sent):
    assert KVReport.from_dict(sent) is None


PARTS = st.builds(
    KVReport,
    source=st.sampled_from(["transfer", "recomputed"]),
    bytes=st.none() | st.integers(0, 10**9),
    transfer_ms=st.none() | st.floats(0, 1e4),
    transport=st.sampled_from(["", "nixl", "cuda_ipc"]),
    reason=st.sampled_from(["", "injected", "gone"]),
    remote_engine_id=st.sampled_from(["", "prefill-0"]),
    remote_ranks=st.lists(st.integers(0, 7), max_size=3, unique=True).map(tuple),
)


@given(st.lists(PARTS, min_size=1, max_size=4))
def test_merge_is_one_rule_and_survives_the_json_form(parts):
    merged = KVReport.merge_all(parts)
    assert merged.source == ("recomputed" if any(p.source == "recomputed" for p in parts) else "transfer")
    assert KVReport.from_dict(merged.as_dict()) == merged
    if len(parts) == 1:
        assert merged == parts[0]  # one part is the report as it came
        return
    said = [p.bytes for p in parts if p.bytes is not None]
    expected = sum(said) if said else None
    if merged.source == "recomputed" and not expected:
        expected = None  # a recompute that read nothing says no bytes
    assert merged.bytes == expected
