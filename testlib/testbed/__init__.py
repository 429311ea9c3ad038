"""A multi-host test bed on one machine: N "hosts" as Linux network namespaces on a bridge, one Ray node each.

Every host is a network namespace ``pds-<name>`` with one veth into the bridge ``pdsbr0`` of the root
namespace; the bridge has 198.18.0.1/24 and host i has 198.18.0.(10+i)/24 (198.18.0.0/15 is the
benchmarking range: no real network uses it). There is no default route, no NAT and no change to
``ip_forward``: nothing the hosts send can leave the machine. The first host runs the Ray head
(GCS on 198.18.0.10:6379), the others Ray worker nodes, each with its own node IP, labels, custom
resource and CPU count. The root namespace reaches every host at its address through the bridge.

Defaults: hosts head, prefill, decode; 2 CPUs each; labels ``pdserve.io/host=<name>`` on every node, and
``pdserve.io/pool=prefill|decode`` on hosts named prefill/decode (also prefill2, decode-b, decode_1, ...); a custom
resource ``host:<name>: 1000`` per node. A label given as "" drops a default label.

``up`` is idempotent: when a bed with the same configuration is running and every node is alive in
the GCS it is reused as it is (``"reused": true``); anything else (another configuration, a dead node,
leftovers of a crashed run) is torn down and made again; ``fresh=True`` always makes it again.
``down`` kills every process in the ``pds-*`` namespaces (SIGTERM, then SIGKILL), deletes them, the
veths and the bridge; it never fails when nothing is there. Ray logs stay in ``/tmp/pds-hosts/<host>``
until the next ``up`` (``PDS_HOSTS_DIR`` moves that directory).

Ray runs with token auth by default (as Ray 2.60 and pdserve's own head do): a client needs
``RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/pds-hosts/auth_token`` besides ``RAY_ADDRESS``;
``exec_argv`` sets all three. Run drivers (``ray.init``) inside a host namespace. Every host
shares the machine's PID namespace and /tmp, so a driver sees every raylet and, given no IP, attaches
to the head's: on another host say ``ray.init(_node_ip_address="198.18.0.11")``. From the root
namespace, plain TCP reaches the hosts, and Ray Client (``ray://198.18.0.10:10001``) works.
The GCS marks a killed host's node dead after Ray's health checks (3 s x 5 by default, ~12 s here);
``ray_env={"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}`` cuts that
to ~3 s. ``up`` and ``down`` run in the root namespace (the bridge is there); the rest anywhere.

Modules, one role each: ``config`` (names, addresses, host specs), ``netns`` (namespaces, bridge, veths),
``procs`` (the processes in a namespace, stopping them), ``state`` (the running bed's state file, client env,
``exec_argv``), ``ray_nodes`` (``ray start`` per host, the GCS node table), ``bed`` (up, down, kill, restart,
status). ``scripts/hosts.py`` is its command line. Use it as ``from testlib import testbed as hosts``.
Needs root, iproute2 and Ray in the project's virtualenv; stdlib only.
"""

from testlib.testbed.bed import down, info, kill_host, restart_host, status, up
from testlib.testbed.config import (
    BRIDGE,
    BRIDGE_IP,
    DEFAULT_CPUS,
    DEFAULT_HOSTS,
    DEFAULT_OBJECT_STORE_MB,
    HOST_PREFIX,
    START_TIMEOUT_S,
    STATE_DIR,
    VETH_PREFIX,
    HostsError,
    default_labels,
    host_specs,
)
from testlib.testbed.netns import namespaces
from testlib.testbed.procs import netns_pids
from testlib.testbed.ray_nodes import nodes, wait_nodes
from testlib.testbed.state import client_env, exec_argv, load_state

__all__ = [
    "BRIDGE",
    "BRIDGE_IP",
    "DEFAULT_CPUS",
    "DEFAULT_HOSTS",
    "DEFAULT_OBJECT_STORE_MB",
    "HOST_PREFIX",
    "START_TIMEOUT_S",
    "STATE_DIR",
    "VETH_PREFIX",
    "HostsError",
    "client_env",
    "default_labels",
    "down",
    "exec_argv",
    "host_specs",
    "info",
    "kill_host",
    "load_state",
    "namespaces",
    "netns_pids",
    "nodes",
    "restart_host",
    "status",
    "up",
    "wait_nodes",
]
