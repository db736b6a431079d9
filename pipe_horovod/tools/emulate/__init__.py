"""A small cluster on one machine: one network namespace per worker.

`cluster` runs the cluster's life (EmulatedCluster: build, launch workers,
wait, tear down), `network` builds the namespaces and capped links (star or
chain), `guard` tears down after an owner killed by SIGKILL. Stdlib only,
so it imports without torch or horovod. What scripts use is re-exported
here: ``from pipe_horovod.tools.emulate import EmulatedCluster``.
"""
from .cluster import (ClusterError, CpuTimes, EmulatedCluster, Launch, cleanup,
                      cpu_times, leftovers, read_progress, tail_file, unavailable_reason,
                      wait_polling)

__all__ = ["EmulatedCluster", "Launch", "ClusterError", "leftovers", "cleanup",
           "unavailable_reason", "cpu_times", "CpuTimes", "read_progress",
           "tail_file", "wait_polling"]
