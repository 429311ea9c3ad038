"""``PdserveMultiConnector``: vLLM's ``MultiConnector`` that can rebuild the stats of our connector.

``MultiConnector`` sends each child's stats from the engine to the front end as
plain data and rebuilds them there by the child's class name through
``KVConnectorFactory``'s registry. ``PdserveConnector`` is loaded through
``kv_connector_module_path``, so it is not in that registry and the rebuild
raised in the front end. Importing this module (which the front end does to
find this class) registers it. Nothing else differs from ``MultiConnector``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

__all__ = ["PdserveMultiConnector"]

if "PdserveConnector" not in KVConnectorFactory._registry:  # noqa: SLF001 - the registry has no query method
    KVConnectorFactory.register_connector("PdserveConnector", "connectors.vllm_connector", "PdserveConnector")


class PdserveMultiConnector(MultiConnector):
    """``MultiConnector`` (see the module's docstring)."""
