"""Moved: the planner is `pipe_horovod.tools.planner`, and the formulas the
collectives use (`Network`, the lp chunk counts) are
`pipe_horovod.collectives.cost_model` (`pipe_horovod.collectives.Network`).
This name stays so scripts written against it keep working (README showed
``Collective("lp", network=pipe_horovod.timing.Network(...))``). Not part of
the runtime: nothing in engine, pipeline, compression, collectives, torch or
keras imports it."""
from pipe_horovod.tools.planner import *  # noqa: F401,F403
