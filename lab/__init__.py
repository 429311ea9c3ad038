"""The validation lab, outside the installed package: what checks pdserve's models against real clusters.

``fidelity`` replays a trace through a running cluster and compares latency quantiles with the
simulator's (``validate_simulator.py``, and ``tests/integration/test_profile.py``);
``autoscale_study.py`` judges the autoscaler against static splits and bounds in simulation; the
probes (``probe_shared_start.py``, ``probe_host_load.py``, ``decode_clocks.py``) measure our CPU test
machines. ``results/`` keeps the runs the README cites; ``tests/`` their unit tests (``make test``
runs them). Run a script from the repository root: ``python lab/validate_simulator.py ...``.
"""
