"""The three CUDA driver calls a CUDA IPC read makes on the host, called directly (``ctypes``, ~1 us each) rather
than through PyTorch's Python objects (~5-15 us each: a read makes a handful, and a 64-MiB read's copy takes ~40 us).

``DriverCalls.load()`` binds ``libcuda.so.1`` (the driver's one instance in the process, whichever runtime PyTorch
brought) or returns None where it cannot; the transport then uses PyTorch's calls (``copy_``, ``Event.record``,
``Stream.wait_event``). The calls need the CUDA context current on the calling thread, as PyTorch's do: the
transport makes them where it launches its copy. A non-zero ``CUresult`` raises ``TransportError``.
"""

from __future__ import annotations

import ctypes
import logging

from connectors.errors import TransportError

__all__ = ["DriverCalls"]

logger = logging.getLogger(__name__)


class DriverCalls:
    def __init__(self, lib: ctypes.CDLL) -> None:
        handle, size = ctypes.c_void_p, ctypes.c_size_t
        self._copy = lib.cuMemcpyHtoDAsync_v2
        self._copy.argtypes = [ctypes.c_uint64, handle, size, handle]
        self._record = lib.cuEventRecord
        self._record.argtypes = [handle, handle]
        self._wait = lib.cuStreamWaitEvent
        self._wait.argtypes = [handle, handle, ctypes.c_uint]
        for function in (self._copy, self._record, self._wait):
            function.restype = ctypes.c_int

    @classmethod
    def load(cls) -> DriverCalls | None:
        try:
            return cls(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError) as e:
            logger.info("CUDA IPC reads use PyTorch's calls: the CUDA driver's cannot be bound here (%s)", e)
            return None

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise TransportError(f"{what} failed: CUresult {result}")

    def copy_to_device(self, device_address: int, host_address: int, nbytes: int, stream: int) -> None:
        """``nbytes`` from pinned host memory to the device, ordered on ``stream`` (a raw ``CUstream``)."""
        self._check(self._copy(device_address, host_address, nbytes, stream), "cuMemcpyHtoDAsync")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cuEventRecord")

    def wait(self, stream: int, event: int) -> None:
        """``stream``'s later work waits for ``event``."""
        self._check(self._wait(stream, event, 0), "cuStreamWaitEvent")
