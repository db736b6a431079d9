"""The benchmark: pipelined vs synchronous vs Horovod vs DDP step time.

`worker.py` runs inside every worker process (launched by horovodrun,
torchrun, plain python or `pipe_horovod.tools.emulate`) and writes raw per-step
times; `report.py` turns them into medians, ratios, predictions and a plot.
`pipe-horovod bench` (pipe_horovod/tools/commands/bench.py) launches and reports.
"""
