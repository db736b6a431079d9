"""Collectives on point-to-point send/recv: linear pipeline, ring, binomial tree, BE.

Pipe-SGD carries its compression inside the allreduce: every hop sends
narrow bytes, the receiver adds in float32 and encodes again, which no
library allreduce does (they sum in the wire's type, where int8 overflows).
Wang et al.'s linear pipeline keeps every link busy, so its cost hardly
grows with p. Both need the algorithm in our hands, so the algorithms live
here, built on torch.distributed isend/irecv over a gloo group (beside
Horovod under horovodrun), and return the engine's handles: the
optimizer's buckets use them through `collective=` unchanged.

Modules: spec (what `collective=` accepts), api (allreduce/reduce/broadcast),
communicator (the thread that runs them), exchange (one collective's
encode/send/receive/decode), layout (blocks and chunk counts), cost_model (the
alpha-beta formulas layout picks lp's chunks by), channel
(tags), group (the gloo group), buffers (persistent buffers), arrivals
(which receives have completed, without blocking), linear_pipeline / ring /
binomial_tree / bidirectional_exchange (the algorithms `collective=` names
"lp", "ring", "mst", "be"), ddp_hooks (the same for torch DDP), quantized
(the other way: int8/fp8 in two stages on the engine's own alltoall and
allgather, NCCL included, no per-hop algorithm; what the optimizer uses
for those codecs when no `collective=` is given).
"""
from .api import allreduce, allreduce_async, broadcast, broadcast_async, reduce, reduce_async
from .cost_model import Network
from .spec import ALGORITHMS, Collective, check_collective

__all__ = ["ALGORITHMS", "Collective", "Network", "check_collective", "allreduce", "allreduce_async",
           "reduce", "reduce_async", "broadcast", "broadcast_async"]
