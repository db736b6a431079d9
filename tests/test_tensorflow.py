"""pipe_horovod.tensorflow: Horovod's TF2 custom-loop API on today's TensorFlow.

The cases (tests/workers/tensorflow_worker.py says what each checks) run in the Keras fit
launch of their engine on the TensorFlow backend (keras_launches.py: one TensorFlow start-up
per engine): horovodrun (Gloo) and torchrun on two ranks, plain python on one. The oracle is
tests/keras_reference.py's pipelined FIFO fed with the same TensorFlow gradients, so the
tape's cases compare bit for bit.
"""
import pytest

import launcher
from keras_launches import TF_CASES, fit_launch

LAUNCHES = [("horovod", 2), ("torch", 2), ("local", 1)]


@pytest.mark.parametrize("case", TF_CASES)
@pytest.mark.parametrize("engine_name,np_", LAUNCHES)
def test_tensorflow_custom_loop(tmp_path_factory, engine_name, np_, case):
    pytest.importorskip("tensorflow")
    launcher.skip_without(engine_name)
    _, code, out = fit_launch(tmp_path_factory, engine_name, "tensorflow", np_)
    launcher.assert_case(code, out, np_, f"tf.{case}",
                         f"keras_worker.py on {engine_name} tensorflow")


def test_check_names_the_tensorflow_adapter(capsys):
    """`pipe-horovod check --framework tensorflow` passes where TensorFlow and Keras import,
    and lists pipe_horovod.tensorflow among the adapters."""
    import argparse

    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    from pipe_horovod.tools.commands import check

    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    rc = check.run(parser.parse_args(["--framework", "tensorflow"]))
    out = capsys.readouterr().out
    assert rc == 0 and "    [X] pipe_horovod.tensorflow" in out.split("adapters:")[1], out
