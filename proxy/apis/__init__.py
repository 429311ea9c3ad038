"""The OpenAI APIs the proxy serves: one module an API, one registry.

Each API is a small stateless object (``proxy.apis.base``): a ``GenerationApi`` says everything that differs
between the APIs served through prefill and decode (its path and request model, the fields it refuses, its
prompt as routing reads it, the prefill leg's body, how a stream of it is continued, its stream events); a
``RelayApi`` is a route one engine answers as it came. The app adds a route for each of ``REGISTRY``; every
request's ``Exchange`` carries its API, and no code outside this package asks which API it is.

Adding an API is its module and one line here.
"""

from __future__ import annotations

from proxy.apis.base import Api, GenerationApi, RelayApi
from proxy.apis.chat import Chat
from proxy.apis.completions import Completions
from proxy.apis.relays import Detokenize, Tokenize
from proxy.apis.responses import Responses

__all__ = ["REGISTRY", "Api", "GenerationApi", "RelayApi"]

REGISTRY: tuple[Api, ...] = (
    Chat(),
    Completions(),
    Responses(),
    Tokenize(),
    Detokenize(),
)
"""Every route the proxy serves for the OpenAI API, each its API's object."""
