"""What a user gets: the workers of the suite run with PIPE_HOROVOD_TUNE=off (their
oracles are fixed configurations; tests/conftest.py), so a check of the default itself
wraps inside `the_default()`, with the variable unset as in a user's shell."""
import contextlib
import os


@contextlib.contextmanager
def the_default():
    saved = os.environ.pop("PIPE_HOROVOD_TUNE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["PIPE_HOROVOD_TUNE"] = saved
