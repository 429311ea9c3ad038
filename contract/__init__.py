"""The cross-process contract of pdserve: what its proxy, orchestrator and connectors agree on.

Below the three others, importing none of them (nor vLLM, Ray or zmq):

- ``wire``: addresses, endpoints, roles, the ``kv_transfer_params`` keys and their one model;
- ``headers``: the response headers the proxy adds;
- ``kv_report``: ``KVReport``, how a request's prompt KV reached its decode engine, and its one ``merge``;
- ``auth``: the cluster secret, the keys derived from it, sealed messages and signed parameters;
- ``framing``: the side channel's frames, which the connectors serve and the proxy sends;
- ``private_files``: files and directories only their owner may read;
- ``errors``: what the package raises on purpose.

Nothing else lives here.
"""
