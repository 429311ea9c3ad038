"""Break the production KV ownership code one promise at a time and show the tests notice each break.

Each mutation below is a one-spot change of ``connectors/`` that breaks one promise of docs/architecture.md's
"Who owns a KV block". For each, the script applies it in place, runs the ownership tests (the fast unit tests
first, then the exploration of ``tests/unit/connectors/test_ownership_model.py``, stopping at the first
failure), restores the file, and prints a table: the mutation, the promise, and the test that killed it (or
SURVIVED). It exits 1 if any mutation survives, and leaves every file as it found it (also on Ctrl-C).

    python scripts/mutate_kv.py               # every mutation (about 10-20 min on 2 cores)
    python scripts/mutate_kv.py --only 3 7    # some of them
    python scripts/mutate_kv.py --explored    # the exploration alone must kill each one
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

UNIT_TESTS = [
    "tests/unit/connectors/test_read_drain.py",
    "tests/unit/connectors/test_leases.py",
    "tests/unit/connectors/test_lease_holder.py",
    "tests/unit/connectors/test_connector_worker.py",
    "tests/unit/connectors/test_connector_scheduler.py",
]
EXPLORATION = ["tests/unit/connectors/test_ownership_model.py"]


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    promise: str
    path: str
    old: str
    new: str


MUTATIONS = [
    Mutation(
        "a release under a pin frees the blocks",
        "a release that names no reader is refused while a reader holds a pin",
        "connectors/leases.py",
        "                if lease.pins:\n                    if by is None:",
        "                if lease.pins and by is not None:\n                    if by is None:",
    ),
    Mutation(
        "a pin of another start is granted",
        "parameters of another start of the engine are answered GONE",
        "connectors/leases.py",
        "if epoch is not None and self.epoch and epoch != self.epoch:",
        "if False:",
    ),
    Mutation(
        "a pin on an ended lease is granted",
        "a READ is posted only under a pin of blocks held for that request",
        "connectors/leases.py",
        "answer = PinAnswer.GONE if request_id in self._ended or request_id in self._finished else PinAnswer.WAIT",
        "answer = PinAnswer.OK if request_id in self._ended or request_id in self._finished else PinAnswer.WAIT",
    ),
    Mutation(
        "a READ seen done past its deadline is trusted",
        "a READ's result is trusted only if it landed before the lease's end less the margin",
        "connectors/reads.py",
        "                if now < self.deadline:\n                    self._move(ReadPhase.DONE)",
        "                if True:\n                    self._move(ReadPhase.DONE)",
    ),
    Mutation(
        "an abort counts as drained",
        "a decode block goes back to vLLM only once no READ can land in it",
        "connectors/reads.py",
        "    return read.drained is True",
        "    return True",
    ),
    Mutation(
        "a NIXL READ whose release NIXL refused counts as drained",
        "a READ is drained only when its transport says no byte can land",
        "connectors/transport/nixl.py",
        "        return self._state is not TransferState.PENDING and self._xfer is None",
        "        return self._state is not TransferState.PENDING",
    ),
    Mutation(
        "a READ is posted before every source granted its pin",
        "a READ is posted only under a pin of every source rank",
        "connectors/reads.py",
        "        if not self.granted.issuperset(self.sources):",
        "        if not self.granted:",
    ),
    Mutation(
        "an undrained READ's blocks are not quarantined",
        "a READ never confirmed drained leaves its blocks quarantined, never reused",
        "connectors/reads.py",
        "                self.quarantined = True\n",
        "",
    ),
    Mutation(
        "quarantined blocks go back to vLLM's pool",
        "a READ never confirmed drained leaves its blocks quarantined, never reused",
        "connectors/scheduler.py",
        "            block.ref_cnt += 1",
        "            pass",
    ),
    Mutation(
        "a record waits past lease + margin for its READ to drain",
        "every lease and record ends within lease + margin",
        "connectors/reads.py",
        "elif now >= min((self.aborted_at or now) + self.drain_timeout_s, self.ends_by):",
        "elif now >= (self.aborted_at or now) + self.drain_timeout_s * 1000:",
    ),
    Mutation(
        "a failed load is not reported as a load error",
        "a failed load is recomputed, never served from the blocks it was loading",
        "connectors/reader.py",
        "        self._load_error_block_ids.update(spec.local_block_ids)\n",
        "",
    ),
    Mutation(
        "a mapping is dropped under a load waiting for its pin",
        "a mapping is dropped only once no record names it",
        "connectors/reader.py",
        "in_use = any(name in record.sources and not record.ended for record in self._records.values())",
        "in_use = any(name in record.sources and record.phase is ReadPhase.READING for record in self._records.values()"
        ")",
    ),
    Mutation(
        "an ended record is not removed",
        "nothing keyed by a request id outlives it",
        "connectors/reader.py",
        "            del self._records[request_id]\n",
        "",
    ),
    Mutation(
        "a READ notification does not end the reader's pin",
        "a lease ends read when its readers' READs landed",
        "connectors/leases.py",
        "                lease.pins.discard(reader_id)\n                done =",
        "                done =",
    ),
    Mutation(
        "a pinned lease expires at its end, not its end plus the grace",
        "a lease under a pin is kept until its reader's notification or release, or its end plus the grace",
        "connectors/leases.py",
        "                if lease.pins and deadline < lease.expires_at + self.grace_s:",
        "                if False:",
    ),
]


def run(tests: list[str], env: dict[str, str]) -> str | None:
    """The first failing test of ``tests`` (None if all pass)."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode == 0:
        return None
    failed = re.search(r"^FAILED (\S+)", done.stdout, re.MULTILINE)
    if failed:
        return failed.group(1)
    return "ERROR: " + (done.stdout + done.stderr).strip().splitlines()[-1][:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="numbers of the mutations to run (1-based)")
    parser.add_argument("--explored", action="store_true", help="run only the exploration against each mutation")
    args = parser.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.only or i in args.only]
    env = dict(os.environ, PDSERVE_EXPLORE_FIRST="1", PYTHONDONTWRITEBYTECODE="1")
    rows, survived = [], 0
    for number, mutation in chosen:
        path = ROOT / mutation.path
        original = path.read_text()
        if original.count(mutation.old) != 1:
            raise SystemExit(f"mutation {number} ({mutation.name}): its code is not found once in {mutation.path}")
        started = time.monotonic()
        try:
            path.write_text(original.replace(mutation.old, mutation.new))
            killer = run(EXPLORATION, env) if args.explored else run(UNIT_TESTS, env) or run(EXPLORATION, env)
        finally:
            path.write_text(original)
        survived += killer is None
        rows.append((number, mutation, killer or "SURVIVED", time.monotonic() - started))
        print(f"{number:2d}. {mutation.name}: {killer or 'SURVIVED'} ({rows[-1][3]:.0f} s)", flush=True)
    print("\n| # | mutation | promise it breaks | killed by |\n|---|---|---|---|")
    for number, mutation, killer, _ in rows:
        print(f"| {number} | {mutation.name} (`{mutation.path}`) | {mutation.promise} | `{killer}` |")
    print(f"\n{len(rows) - survived} of {len(rows)} mutations killed")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
