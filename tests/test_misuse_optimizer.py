"""Misuse, the optimizer side: edits of `.grad` between backward and step, weight edits
between steps, and the one-line checks, each asserted on every rank.

Every case (tests/workers/misuse_optimizer_worker.py) runs in the launch of
test_hardening_optimizer.py's cases of each engine, last (tests/shared_launches.py).
"""
import pytest

import shared_launches


@pytest.mark.parametrize("engine_name, np", shared_launches.HARDENING_LAUNCHES)
def test_misuse_is_honoured_or_named(engine_name, np):
    shared_launches.hardening_case(engine_name, np, "misuse")


def test_keras_broadcast_callback_names_an_unwrapped_optimizer(monkeypatch):
    keras = pytest.importorskip("keras")
    from pipe_horovod.keras import callbacks

    monkeypatch.setattr(callbacks.engine, "size", lambda: 2)
    with pytest.warns(UserWarning, match="never average their gradients"):
        callbacks._say_if_not_pipelined(keras.optimizers.SGD(0.1))


def test_keras_saved_optimizer_names_pipe_horovod():
    """Keras resolves a class of a keras module by name: saved under the user's module, a
    file loaded without pipe_horovod became a plain SGD given our config ("Argument(s) not
    recognized"); under ours, Keras's error says to import it. Saving says so once."""
    keras = pytest.importorskip("keras")
    import pipe_horovod.keras as hvd
    from pipe_horovod.keras import optimizer

    hvd.init("local")
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        assert type(opt).__module__ == "pipe_horovod.keras.optimizer"
        optimizer._told_saving.clear()
        with pytest.warns(UserWarning, match="loads where pipe_horovod.keras is imported"):
            config = keras.saving.serialize_keras_object(opt)
        assert config["module"] == "pipe_horovod.keras.optimizer"
        assert config["registered_name"] == "pipe_horovod>DistributedOptimizer"
    finally:
        hvd.shutdown()


def test_an_optimizer_wrapped_twice_is_refused_naming_both_wrappers():
    """Ours over ours, and ours over Horovod's own: each would reduce every gradient a
    second time (twice the delay when pipelined); the refusal names who wrapped it first
    and who was asked to wrap it again."""
    import torch
    import pipe_horovod.torch as phvd

    model = torch.nn.Linear(2, 2)
    phvd.init("local")
    try:
        ours = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="wrap the original torch.optim optimizer once: "
                           "pipe_horovod.torch.DistributedOptimizer wraps it, and "
                           "pipe_horovod.torch.DistributedOptimizer would reduce every gradient "
                           "a second time"):
            phvd.DistributedOptimizer(ours)
        horovod = pytest.importorskip("horovod.torch")
        horovod.init()
        try:
            theirs = horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                  named_parameters=model.named_parameters())
            with pytest.raises(ValueError, match="horovod.torch.DistributedOptimizer wraps it, "
                               "and pipe_horovod.torch.DistributedOptimizer would reduce"):
                phvd.DistributedOptimizer(theirs)
        finally:
            horovod.shutdown()
    finally:
        phvd.shutdown()
