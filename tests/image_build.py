"""Our Docker image for the tests that run it (test_image.py; test_slurm.py's OCI
containers): a Docker daemon, started where this machine may, and the image built by
scripts/image.sh (Docker's layer cache makes that seconds when nothing changed), or the
one PIPE_HOROVOD_IMAGE names. Each skips its test with the reason where it cannot."""
import os
import subprocess

import pytest

import launcher

TAG = "pipe-horovod:test"


def daemon():
    """A Docker daemon answering, else the test skipped."""
    res = subprocess.run(["bash", str(launcher.REPO / "scripts" / "docker_daemon.sh")],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.skip(f"no Docker daemon: {res.stderr.strip()}")


def build(tag, *build_args):
    """Tag `tag` built by scripts/image.sh (CUDA_CC_LIST from the environment)."""
    env = {**os.environ, "IMAGE": tag, "IMAGE_TEST": "0", "BUILD_ARGS": " ".join(build_args)}
    res = subprocess.run(["bash", str(launcher.REPO / "scripts" / "image.sh")], env=env,
                         capture_output=True, text=True, timeout=3600)
    if res.returncode == 3:                     # the machine cannot: no daemon, too little disk
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, f"scripts/image.sh failed:\n{res.stdout}\n{res.stderr}"
    return tag


def image():
    """The image under test: PIPE_HOROVOD_IMAGE, else TAG built now."""
    daemon()
    return os.environ.get("PIPE_HOROVOD_IMAGE") or build(TAG)
