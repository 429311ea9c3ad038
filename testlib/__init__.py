"""The test library that tests, scripts and lab share (never installed): the namespace test bed (``testbed``), a
running cluster's client (``cluster_client``), trace replay and the simulator's fidelity (``fidelity``), CPU
accounting of process trees (``cpu_use``), plain vLLM (``plain_vllm``), multi-turn chats (``multiturn``), made-up
profiles (``profiles``), random LoRA adapters (``lora``), spec copies (``specs``) and the CUDA IPC bench's blocks
(``cuda_ipc_blocks``). It imports the package, never a script."""
