"""`pipe-horovod convergence-lm`: the transformer task of the convergence study, where a
plain one-step delay hurts an AdamW model that synchronous training handles (docs/convergence.md).

A character-level transformer trained with AdamW (warm-up + cosine, clipping of
the averaged gradient), sync vs the default (K=2, lookahead) vs plain K=2, in
the PyTorch adapter and in Keras 3 on TensorFlow and on torch. A separate
command from `pipe-horovod convergence` because it reports validation loss
per step, not held-out accuracy per epoch; pipe_horovod/tools/bench/convergence_lm.py
says what runs.
"""
from pipe_horovod.tools.bench import convergence_lm as _lm


def add_arguments(parser):
    _lm.add_arguments(parser)


def run(args):
    argv = None
    import sys
    if len(sys.argv) > 1 and sys.argv[1] == "convergence-lm":
        argv = sys.argv[2:]
    return _lm.run(args, argv)
