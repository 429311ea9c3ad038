"""The state of the cluster this machine started: its file (``cluster.json``) and its secret, in the state
directory (``$PDSERVE_STATE_DIR``, default ``~/.cache/pdserve/run``), both mode 0600."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from contract.auth import SECRET_ENV, SECRET_FILE_ENV, ClusterSecret, load_secret, new_secret, read_secret_file
from contract.private_files import make_private_dirs, write_private
from orchestrator.control import ControlClient
from orchestrator.errors import ClusterNotRunning
from orchestrator.paths import pdserve_dir

__all__ = ["CONTROLLER_SUFFIX", "ClusterState", "load_cluster_secret", "secret_for_up", "secret_path", "state_dir"]

CONTROLLER_SUFFIX = "-controller"


def state_dir() -> Path:
    return pdserve_dir("run", "PDSERVE_STATE_DIR")


@dataclass(slots=True)
class ClusterState:
    name: str
    namespace: str
    config: str
    ray_address: str
    started_ray: bool
    ray_temp_dir: str | None
    log_dir: str
    proxy_url: str
    api_url: str = ""  # the controller's HTTP API, once it serves
    api_token: str = ""  # the cluster's token for it: never printed or logged

    @property
    def controller_name(self) -> str:
        return self.name + CONTROLLER_SUFFIX

    def client(self, timeout_s: float = 30.0) -> ControlClient:
        if not self.api_url:
            raise ClusterNotRunning(f"cluster {self.name!r} has no controller API recorded in {self.path()}")
        return ControlClient(self.api_url, self.api_token, timeout_s)

    @staticmethod
    def path() -> Path:
        return state_dir() / "cluster.json"

    def save(self) -> None:
        make_private_dirs(self.path().parent)
        write_private(self.path(), json.dumps(asdict(self), indent=2))  # 0600: it holds the cluster's token

    @classmethod
    def load(cls) -> ClusterState:
        try:
            return cls(**json.loads(cls.path().read_text()))
        except FileNotFoundError:
            raise ClusterNotRunning(f"no pdserve cluster is running (no {cls.path()})") from None

    @classmethod
    def clear(cls) -> None:
        cls.path().unlink(missing_ok=True)
        secret_path().unlink(missing_ok=True)


def secret_path() -> Path:
    """The running cluster's secret (mode 0600): for ``pdserve proxy --cluster-secret-file`` and tools
    that call its engines (``load_cluster_secret``)."""
    return state_dir() / "cluster-secret"


def secret_for_up(environ: Mapping[str, str] | None = None) -> ClusterSecret:
    """The secret of the cluster ``up`` starts: the one the caller's environment gives
    (``PDSERVE_CLUSTER_SECRET``, or the file ``PDSERVE_CLUSTER_SECRET_FILE`` names), else a new one.

    The KV tier does not depend on it: its entries are MAC'd under the tier's own key, kept in its
    directory (``connectors.tier.key``), so a cluster started with a new secret loads what an earlier
    one stored.
    """
    environ = os.environ if environ is None else environ
    if environ.get(SECRET_ENV, "").strip() or environ.get(SECRET_FILE_ENV, "").strip():
        return load_secret(environ)
    return new_secret()


def load_cluster_secret() -> ClusterSecret:
    """The running cluster's secret, from the state directory."""
    if not secret_path().exists():
        raise ClusterNotRunning(f"no pdserve cluster is running (no {secret_path()})")
    return read_secret_file(secret_path())
