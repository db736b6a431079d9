"""The toolbox beside the runtime: everything training never needs.

`cli` and `commands/` (the `pipe-horovod` command), `bench/` (benchmark and
convergence launchers, workers and reports), `workloads/` (real models'
layer tables and replayed compute). The tooling imports the runtime
(engine, pipeline, compression, collectives, torch, keras); the runtime
never imports the tooling (tests/test_layout.py checks it).
"""
