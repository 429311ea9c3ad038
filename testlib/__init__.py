"""The test library that tests, scripts and lab share (never installed): the namespace test bed (``testbed``), a
running cluster's client (``cluster_client``), request-trace replay (``replay``), CPU accounting of process trees
(``cpu_use``) and the CUDA IPC bench's blocks (``cuda_ipc_blocks``). It imports the package, never a script."""
