"""Moved to `pipe_horovod.tools.emulate`; this name stays so scripts written
against it keep working (``from pipe_horovod.emulate import EmulatedCluster``).
Not part of the runtime: nothing in engine, pipeline, compression,
collectives, torch or keras imports it."""
from pipe_horovod.tools.emulate import *  # noqa: F401,F403
from pipe_horovod.tools.emulate import __all__  # noqa: F401
