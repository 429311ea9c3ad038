"""A multi-host test bed on one machine: N "hosts" as Linux network namespaces on a bridge, one Ray node each.

    python scripts/hosts.py up [--hosts head,prefill,decode] [--cpus 2 | --cpus prefill=4]
                               [--labels HOST=KEY=VALUE ...] [--resources HOST=NAME=AMOUNT ...]
                               [--gpus HOST=N ...] [--object-store-mb 200] [--auth token|disabled]
                               [--ray-env KEY=VALUE ...] [--timeout 120] [--fresh] [--json [PATH]]
    python scripts/hosts.py status [--json]
    python scripts/hosts.py exec HOST [--no-env] -- CMD...
    python scripts/hosts.py kill HOST [--wait]        # SIGKILL everything on HOST (a host loss)
    python scripts/hosts.py restart HOST              # its Ray node again, same IP, labels, resources
    python scripts/hosts.py down

Host i is the namespace ``pds-<name>`` at 198.18.0.(10+i) on the bridge ``pdsbr0``; the first is the Ray head.
``--labels HOST=KEY=`` (empty value) drops a default label. This is the command line of the test library
``testlib/testbed`` (``from testlib import testbed as hosts``), whose docstring describes the bed. Needs root.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testlib.testbed.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
