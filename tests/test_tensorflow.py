"""pipe_horovod.tensorflow (issue 38): Horovod's TF2 custom-loop API on today's TensorFlow.

One launch per engine runs every case (tests/workers/tensorflow_worker.py says what
each checks): horovodrun (Gloo) and torchrun on two ranks, plain python on one. The
oracle is tests/keras_reference.py's pipelined FIFO fed with the same TensorFlow
gradients, so the tape's cases compare bit for bit.
"""
import pytest

import launcher

CASES = ("api", "tape", "optimizer", "checkpoint", "errors", "partial", "autodiff")
LAUNCHES = [("horovod", 2), ("torch", 2), ("local", 1)]


@pytest.fixture(scope="session")
def tensorflow_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tensorflow")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("engine_name,np_", LAUNCHES)
def test_tensorflow_custom_loop(tensorflow_dir, engine_name, np_, case):
    pytest.importorskip("tensorflow")
    if engine_name == "horovod" and launcher.horovod_missing():
        pytest.skip(launcher.horovod_missing())
    launcher.run_case(engine_name, np_, "tensorflow_worker.py", CASES, case,
                      tensorflow_dir / f"{engine_name}{np_}", timeout=420,
                      env={"KERAS_BACKEND": "tensorflow"})


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
