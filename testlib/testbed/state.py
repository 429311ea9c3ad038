"""The running bed's state file (``STATE_DIR/state.json``) and what a client of the bed needs from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from testlib.testbed.config import CLI, HOST_PREFIX, STATE_DIR, HostsError


def state_path() -> Path:
    return STATE_DIR / "state.json"


def load_state() -> dict | None:
    try:
        return json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None


def require_state() -> dict:
    state = load_state()
    if state is None:
        raise HostsError(f"no bed is up (no {state_path()}): run `python {CLI} up` first")
    return state


def host_of(state: dict, name: str) -> dict:
    for host in state["hosts"]:
        if host["name"] == name:
            return host
    raise HostsError(f"no host {name!r} in the bed (hosts: {[h['name'] for h in state['hosts']]})")


def clean_state_dir() -> None:
    """Remove what the last bed left in STATE_DIR (its token, its Ray temp dirs and logs), nothing else."""
    STATE_DIR.mkdir(parents=True, mode=0o700, exist_ok=True)
    for entry in STATE_DIR.iterdir():
        if entry.name in ("state.json", "auth_token") or entry.name.endswith(".start.log"):
            entry.unlink()
        elif entry.is_dir() and ((entry / "session_latest").is_symlink() or (entry / "ray_current_cluster").exists()):
            shutil.rmtree(entry)


def client_env(state: dict | None = None) -> dict[str, str]:
    """The variables a Ray client of the bed needs: RAY_ADDRESS and the auth mode (and token path)."""
    state = state or require_state()
    env = {"RAY_ADDRESS": state["ray_address"], "RAY_AUTH_MODE": state["auth"]}
    if state["auth"] == "token":
        env["RAY_AUTH_TOKEN_PATH"] = state["token_path"]
    return env


def exec_argv(host: str, argv: list[str], *, env: bool = True) -> list[str]:
    """``argv`` run inside ``host``'s namespace: ``ip netns exec pds-<host> [env RAY_...=...] argv...``.

    With ``env`` (and a bed up) the Ray client variables of ``client_env`` are set for the command.
    """
    prefix = ["ip", "netns", "exec", HOST_PREFIX + host]
    state = load_state() if env else None
    if state is not None:
        prefix += ["env", *(f"{k}={v}" for k, v in client_env(state).items())]
    return [*prefix, *argv]
