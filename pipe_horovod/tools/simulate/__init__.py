"""The data plane on SimGrid: one training step's messages run on a simulated cluster.

The planner (pipe_horovod.pipeline.timing_model) assumes a full-bisection network where
every worker sends at its link's rate; clusters of hundreds of workers have racks behind
oversubscribed uplinks and nodes of 8 GPUs behind one NIC. Here the messages each system
really sends (Horovod's fused ring, our buckets at K=1 and K=2, the two-stage codecs'
alltoall and allgather, the linear pipeline's chain, Horovod's hierarchical allreduce)
run on SimGrid's flow-level network model over topologies built in code, and the
planner's prediction is printed beside each result so the two can be compared.

topology.py: what a topology spec means (pure Python); collectives.py: the rounds of
flows each collective sends (pure Python); engine.py: the SimGrid run, in its own process
(SimGrid's engine is one per process); schedule.py: the rows (which buckets, which
collective, which K) and the planner's prediction of each.
"""
