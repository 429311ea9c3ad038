"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: served by one ready engine of the model, no KV moved,
relayed as the engine answers."""

from __future__ import annotations

from contract import wire
from proxy.apis.base import RelayApi

__all__ = ["Detokenize", "Tokenize"]


class Tokenize(RelayApi):
    name = "tokenize"
    path = wire.TOKENIZE_PATH


class Detokenize(RelayApi):
    name = "detokenize"
    path = wire.DETOKENIZE_PATH
