"""``pdserve proxy``: the P/D proxy alone (no Ray) in front of vLLM servers started by hand with a KV connector.
Its settings are a cluster spec's ``proxy`` section, from ``--config FILE`` with a flag for each laid over it
(``orchestrator.model_flags``, generated from ``ProxySettings``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from orchestrator.cli.common import positive_int, say
from orchestrator.errors import SpecError

DEFAULT_PROXY_WORKERS = 1


def add_commands(commands: Any, wanted: Any) -> None:
    proxy = commands.add_parser(
        "proxy",
        help="run the P/D proxy alone (no Ray) in front of vLLM servers started with a KV connector",
        description="Serve the OpenAI API; send each request's prefill to a --prefill server and its decode "
        "to a --decode server (round robin, or as --routing-prefill / --routing-decode say), carrying the KV "
        "transfer parameters between them.",
    )
    proxy.set_defaults(func=cmd_proxy)
    if wanted("proxy"):
        _add_proxy_args(proxy)


def proxy_settings(args: argparse.Namespace) -> Any:
    """``pdserve proxy``'s settings: ``--config FILE``'s, with the flags given laid over them."""
    from pydantic import ValidationError

    from orchestrator.errors import read_mapping
    from orchestrator.model_flags import given, overlay
    from proxy.config import ProxySettings

    source = args.config or "the command line"
    raw = read_mapping(args.config) if args.config else {}
    try:
        return ProxySettings.model_validate(overlay(raw, given(args)))
    except ValidationError as e:
        raise SpecError.of(source, e) from e


def cmd_proxy(args: argparse.Namespace) -> int:
    import logging

    from proxy.admin import parse_networks
    from proxy.auth import load_engine_key, load_keys
    from proxy.config import ProxyConfig
    from proxy.errors import ProxyConfigError
    from proxy.server import serve
    from proxy.standalone import (
        StandaloneError,
        StandaloneSettings,
        app_factory,
        model_name_from_engines,
        normalize_url,
        parse_kv_endpoints,
    )

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from contract.auth import PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV, SECRET_ENV, SECRET_FILE_ENV

    try:
        settings = proxy_settings(args)
    except SpecError as e:
        print(f"pdserve proxy: invalid settings:\n{e}", file=sys.stderr)
        return 2
    # The workers inherit these; only the files' names travel. The engine key alone is enough (least
    # privilege: `pdserve secret PATH --engine-key-file OUT`); a secret file is read only to derive it.
    if args.engine_key_file:
        os.environ[PROXY_ENGINE_KEY_FILE_ENV] = args.engine_key_file
    if args.cluster_secret_file:
        os.environ[SECRET_FILE_ENV] = args.cluster_secret_file
    engine_auth = any(
        os.environ.get(name) for name in (PROXY_ENGINE_KEY_ENV, PROXY_ENGINE_KEY_FILE_ENV, SECRET_ENV, SECRET_FILE_ENV)
    )
    try:
        prefill = [normalize_url(url) for url in args.prefill]
        decode = [normalize_url(url) for url in args.decode]
        decode_kv = parse_kv_endpoints(args.decode_kv, len(decode))
        model, *adapters = (
            (args.model,)
            if args.model
            else model_name_from_engines(
                prefill + decode,
                args.wait_s,
                engine_key=load_engine_key() if engine_auth else None,
                on_wait=lambda missing: say(
                    f"pdserve proxy: waiting up to {args.wait_s:g}s for {', '.join(missing)} to answer /v1/models "
                    "(--model skips this)"
                ),
            )
        )
    except StandaloneError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 1
    config = ProxyConfig.of(
        settings,
        model_name=model,
        adapters=tuple(adapters),
        engine_auth=engine_auth,
        max_model_len=args.max_model_len,
    )
    try:  # here, not only in each worker: a key that cannot be read stops the command with its reason
        load_keys(config.api_key_env, config.api_key_file)
        load_keys(config.admin_key_env, config.admin_key_file)
        parse_networks(config.admin_engine_networks)
        if engine_auth:
            load_engine_key()
    except ProxyConfigError as e:
        print(f"pdserve proxy: {e}", file=sys.stderr)
        return 1
    standalone = StandaloneSettings(tuple(prefill), tuple(decode), config, decode_kv)

    def ready(url: str) -> None:
        say(f"pdserve proxy: serving {model!r} on {url}/v1 ({args.workers} worker(s))")
        say(f"  prefill: {' '.join(prefill)}")
        say(f"  decode:  {' '.join(decode)}")
        say(f"  routing: prefill {config.routing.prefill}, decode {config.routing.decode}")

    try:
        return serve(app_factory(standalone), config.host, config.port, args.workers, on_ready=ready)
    except OSError as e:
        print(f"pdserve proxy: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1


def _add_proxy_args(proxy: argparse.ArgumentParser) -> None:
    from orchestrator.model_flags import add_model_flags
    from proxy.config import ProxySettings

    engines = proxy.add_argument_group("engines (pdserve proxy only)")
    engines.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers' URLs")
    engines.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers' URLs")
    engines.add_argument(
        "--decode-kv", nargs="+", default=[], metavar="TCP[,TCP...]",
        help="for decode servers of the pdserve connector: each one's side channel, tcp://host:kv_port per TP "
        "rank (comma-separated), one value per --decode server in its order; streams then carry X-PDServe-KV",
    )  # fmt: skip
    engines.add_argument("--model", help="the served model's name (default: asked from the engines' /v1/models)")
    engines.add_argument(
        "--wait-s",
        type=float,
        default=600.0,
        help="without --model: how long to wait for the engines to answer /v1/models (default: %(default)s)",
    )
    engines.add_argument(
        "--max-model-len", type=positive_int, help="the engines' context length: refuse what plainly exceeds it"
    )
    engines.add_argument(
        "--engine-key-file", metavar="PATH",
        help="the engines' key, which the proxy sends them (`pdserve secret SECRET --engine-key-file PATH` "
        "writes it; or PDSERVE_ENGINE_KEY): all the proxy needs, rather than the cluster secret",
    )  # fmt: skip
    engines.add_argument(
        "--cluster-secret-file", metavar="PATH",
        help="the cluster secret (`pdserve secret PATH` makes one; or PDSERVE_CLUSTER_SECRET): the proxy sends "
        "the engine key derived from it (hand-started engines: VLLM_API_KEY from "
        "`pdserve secret PATH --engine-key-file OUT`); --engine-key-file, when given, is used instead",
    )  # fmt: skip
    engines.add_argument(
        "--workers", type=positive_int, default=DEFAULT_PROXY_WORKERS, help="proxy processes (default: %(default)s)"
    )
    settings = proxy.add_argument_group(
        "settings (a cluster spec's `proxy` section; keys are read from the environment or a file, never the "
        "command line)"
    )
    settings.add_argument(
        "--config", metavar="FILE",
        help="a YAML file of these settings, keyed as a cluster spec's `proxy` section (`pdserve schema proxy`); "
        "flags override it",
    )  # fmt: skip
    add_model_flags(settings, ProxySettings)
