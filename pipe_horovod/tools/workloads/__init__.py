"""Real model workloads without real compute.

`architectures` gives the per-layer parameter table and forward FLOPs of real
models (ResNet-50, VGG-16, a BERT-base encoder, and the bench's MLP / CNN),
built on the `meta` device so nothing is allocated; `replay` turns such a
table into a module whose forward and backward are timed waits, so a benchmark
on CPU-only machines sees an accelerator's compute schedule. `synthetic` builds
the bench's MLP / CNN of a given size (pipe_horovod.tools.bench.models uses it).
"""
