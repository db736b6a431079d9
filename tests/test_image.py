"""The Docker image, run as users run it (`make image` builds it, then runs this).

One container: `pipe-horovod check` shows what is built, says in one
line that no GPU is visible and in one that the int8/fp8 codec runs the prebuilt
C kernels (the image has no compiler); the digits comparison of `make run` (2 workers
under horovodrun) gives the same accuracies as `make run` on this machine.
Two containers as two nodes: sshd in each (node1 on 127.0.0.1, node2 on
127.0.0.2, both loopback, one port), one key pair mounted read-only as
Kubeflow's MPIJob mounts it, `horovodrun -H node1:1,node2:1 -p PORT` and
`mpirun` from node1 train across both with the same weights on both ranks;
`docker kill` of node2 mid-run makes node1 exit non-zero within 60 s naming
the lost rank and node. As root, and as the image's non-root USER_NAME option.

Where no Docker daemon answers and none can be started (not root, no
docker.io), or the disk lacks the ~25 GB a first build takes, every test is
skipped with that reason. PIPE_HOROVOD_IMAGE names
an image built already; otherwise scripts/image.sh builds one (Docker's layer
cache makes that seconds when nothing changed).
"""
import json
import os
import re
import shlex
import socket
import subprocess
import time

import pytest

import launcher

# The first run builds the image (minutes; Docker caches the layers for the next).
pytestmark = pytest.mark.timeout(3600)
REPO = launcher.REPO
PORT = 20000 + os.getpid() % 20000           # sshd's port in both containers
NODES = {"node1": "127.0.0.1", "node2": "127.0.0.2"}
TRAINER = "trainer"                          # the non-root USER_NAME, as in the docs
EPOCHS = 3


def sh(*cmd, timeout=600, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, f"{shlex.join(cmd)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def docker():
    res = subprocess.run(["bash", str(REPO / "scripts" / "docker_daemon.sh")], capture_output=True,
                         text=True, timeout=300)
    if res.returncode != 0:
        pytest.skip(f"no Docker daemon: {res.stderr.strip()}")


def build(tag, *build_args):
    """Tag `tag` built by scripts/image.sh (CUDA_CC_LIST from the environment)."""
    env = {**os.environ, "IMAGE": tag, "IMAGE_TEST": "0", "BUILD_ARGS": " ".join(build_args)}
    res = subprocess.run(["bash", str(REPO / "scripts" / "image.sh")], env=env, capture_output=True,
                         text=True, timeout=3600)
    if res.returncode == 3:                     # the machine cannot: no daemon, too little disk
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, f"scripts/image.sh failed:\n{res.stdout}\n{res.stderr}"
    return tag


@pytest.fixture(scope="module")
def image(docker):
    return os.environ.get("PIPE_HOROVOD_IMAGE") or build("pipe-horovod:test")


@pytest.fixture(scope="module")
def trainer_image(docker, image):
    # Only the last layers differ: the user, its sshd config, the repository's owner.
    return build(f"{image}-{TRAINER}", f"--build-arg USER_NAME={TRAINER}", "--build-arg SSH_PORT=2222")


def docker_run(image, *cmd, options=()):
    return ["docker", "run", "--rm", "--network", "host", *options, image, *cmd]


def test_check_shows_the_build_and_says_no_gpu(image):
    # The image's CMD: pipe-horovod check.
    res = subprocess.run(docker_run(image), capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "Traceback" not in out, out
    ops = out.split("horovod tensor operations:")[1].split(":\n")[0]
    for built in ("nccl", "mpi", "gloo"):
        assert f"[X] {built}" in ops, out
    assert re.search(r"\[X\] cuda 13\.\d", out), out
    assert re.search(r"\[X\] keras 3\.", out) and re.search(r"\[X\] tensorflow 2\.", out), out
    gpu_lines = [line for line in out.splitlines() if "GPU" in line]
    assert gpu_lines == ["no GPU visible (no NVIDIA driver or device here; in a container, run it "
                         "with --gpus all): training runs on the CPU"], out
    # The int8/fp8 codec's kernels, built in the build stage: loaded from the file the
    # image's PIPE_HOROVOD_NATIVE_LIBRARY names, not compiled (the image has no compiler).
    assert "int8/fp8 codec on CPU: native kernels (/opt/pipe_horovod/lib/cpu_kernels.so)" in out, out


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_digits_comparison_matches_make_run(image, framework, tmp_path):
    """compare_digits.py in the container and in this machine's .venv: the same seed, data
    order and float32 CPU kernels of the same torch release, so the same accuracies."""
    argv = ["examples/compare_digits.py", "--np", "2", "--framework", framework,
            "--epochs", str(EPOCHS)]
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    # Side by side, to overlap their start-ups. Exit 1 is compare_digits' verdict on the
    # accuracy gap (3 epochs is short), 2 a failed run.
    runs = {where: subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
            for where, cmd in (
                ("container", docker_run(image, "python", *argv, "--json", "/out/container.json",
                                         options=("-v", f"{out}:/out"))),
                ("host", [launcher.BIN / "python", *argv, "--json", str(out / "host.json")]))}
    try:
        logs = {where: job.communicate(timeout=900)[0] for where, job in runs.items()}
    finally:
        for job in runs.values():
            job.kill()
    codes = {where: job.returncode for where, job in runs.items()}
    assert codes["container"] in (0, 1) and codes["host"] == codes["container"], (codes, logs)
    got, want = (json.loads((out / f"{where}.json").read_text()) for where in ("container", "host"))
    assert set(accuracies(got)) == {"sync", "pipelined"}
    assert accuracies(got) == accuracies(want), (got, want)


def accuracies(comparison):
    return {run["label"]: run["accuracy"] for run in comparison["runs"]}


# ---- two containers, two nodes ----

@pytest.fixture
def keys(tmp_path):
    """One key pair as the MPI Operator mounts it: id_rsa, id_rsa.pub, authorized_keys."""
    d = tmp_path / "ssh"
    d.mkdir()
    sh("ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(d / "id_rsa"))
    (d / "authorized_keys").write_text((d / "id_rsa.pub").read_text())
    return d


class Cluster:
    """node1 and node2: one container each, host network, sshd on its own loopback address."""

    def __init__(self, image, keys, user):
        self.image, self.user = image, user
        self.home = "/root" if user == "root" else f"/home/{user}"
        if user != "root":                      # Kubernetes' fsGroup/defaultMode does this
            uid = int(sh("docker", "run", "--rm", image, "id", "-u").stdout)
            sh("chown", "-R", str(uid), str(keys))
        self.keys = keys
        self.names = {node: f"ph-{os.getpid()}-{node}" for node in NODES}

    def __enter__(self):
        # --add-host replaces the hosts file, which also named this machine (the containers'
        # hostname on the host network); Gloo looks its own name up.
        names = {**NODES, socket.gethostname(): "127.0.0.1"}
        hosts = [a for node, addr in names.items() for a in ("--add-host", f"{node}:{addr}")]
        config = [] if self.user == "root" else ["-f", f"{self.home}/.sshd_config"]
        for node, addr in NODES.items():
            sh("docker", "run", "-d", "--rm", "--network", "host", "--name", self.names[node],
               *hosts, "-v", f"{self.keys}:{self.home}/.ssh:ro", self.image,
               "/usr/sbin/sshd", "-De", *config, "-o", f"ListenAddress={addr}", "-p", str(PORT))
        deadline = time.monotonic() + 30
        for node in NODES:                       # sshd answers on both before anything starts
            while subprocess.run(["docker", "exec", self.names["node1"], "ssh", "-p", str(PORT),
                                  "-o", "BatchMode=yes", "-o", "ConnectTimeout=2", node, "true"],
                                 capture_output=True).returncode != 0:
                assert time.monotonic() < deadline, f"sshd on {node} does not answer: {self.logs(node)}"
                time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for name in self.names.values():
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)

    def logs(self, node):
        res = subprocess.run(["docker", "logs", self.names[node]], capture_output=True, text=True)
        return res.stdout + res.stderr

    def exec(self, *cmd):
        return ["docker", "exec", "-w", "/opt/pipe_horovod", self.names["node1"], *cmd]


def digits(epochs):
    return ["/opt/venv/bin/python", "examples/pytorch_digits.py", "--epochs", str(epochs),
            "--no-progress"]


def horovodrun(epochs):
    # --gloo: horovodrun would pick MPI (built in), which mpirun() below covers.
    return ["horovodrun", "--gloo", "-np", "2", "-H", "node1:1,node2:1", "-p", str(PORT),
            *digits(epochs)]


def mpirun(epochs):
    # Both "nodes" share this machine's loopback, which Open MPI's TCP transports skip unless told.
    return ["mpirun", "-np", "2", "-H", "node1:1,node2:1", "--mca", "plm_rsh_args", f"-p {PORT}",
            "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
            "--mca", "btl", "tcp,self", *digits(epochs)]


@pytest.mark.parametrize("user", ["root", TRAINER])
def test_two_containers_train_as_two_nodes(request, user, keys):
    image = request.getfixturevalue("image" if user == "root" else "trainer_image")
    with Cluster(image, keys, user) as cluster:
        for name, cmd in (("horovodrun", horovodrun(1)), ("mpirun", mpirun(1))):
            res = subprocess.run(cluster.exec(*cmd), capture_output=True, text=True, timeout=600)
            out = res.stdout + res.stderr
            assert res.returncode == 0, f"{name} as {user}:\n{out}"
            assert "size=2" in out and "ranks agree on the weights: True" in out, f"{name}:\n{out}"


def test_killed_node_stops_the_other_naming_the_lost_rank(image, keys):
    with Cluster(image, keys, "root") as cluster:
        job = subprocess.Popen(cluster.exec(*horovodrun(50)), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        lines = []
        try:
            for line in job.stdout:              # training is under way on both nodes
                lines.append(line)
                if re.search(r"epoch +1/50", line):
                    break
            else:
                pytest.fail("the job ended before its first epoch:\n" + "".join(lines))
            sh("docker", "kill", cluster.names["node2"])
            killed = time.monotonic()
            rest, _ = job.communicate(timeout=120)
            waited = time.monotonic() - killed
        finally:
            job.kill()
        out = "".join(lines) + rest
        assert job.returncode != 0, out
        assert waited < 60, f"node1 took {waited:.0f} s to exit:\n{out}"
        # horovodrun sees rank 1's ssh session end and stops rank 0 itself, naming both the
        # rank (its "process") and the node; our engine's own message (rank 1 lost, its last
        # step) is what a survivor prints when the launcher leaves it running (test_faults).
        assert re.search(r"Process 1 exit with status code \d+", out), f"rank 1 not named:\n{out}"
        assert "Connection to node2 closed" in out, out
