"""The Docker image, run as users run it (`make image` builds it, then runs this).

One container: `pipe-horovod check` shows what is built, says in one
line that no GPU is visible and in one that the int8/fp8 codec runs the prebuilt
C kernels (the image has no compiler). One more: the digits comparison of `make run`
(2 workers under horovodrun), PyTorch's then Keras's, gives the same accuracies as
`make run` on this machine.
Two containers as two nodes: sshd in each (node1 on 127.0.0.1, node2 on
127.0.0.2, both loopback, one port), one key pair mounted read-only as
Kubeflow's MPIJob mounts it, `horovodrun -H node1:1,node2:1 -p PORT` and
`mpirun` from node1 train across both with the same weights on both ranks;
`docker kill` of node2 mid-run makes node1 exit non-zero within 60 s naming
the lost rank and node (in the root pair of containers, after it trained). As root,
and as the image's non-root USER_NAME option.

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

import image_build
import launcher
import shared_launches

# The first run builds the image (minutes; Docker caches the layers for the next).
pytestmark = pytest.mark.timeout(3600)
REPO = launcher.REPO
PORT = 20000 + os.getpid() % 20000           # sshd's port in both containers (the trainer's: +1)
NODES = {"node1": "127.0.0.1", "node2": "127.0.0.2"}
TRAINER = "trainer"                          # the non-root USER_NAME, as in the docs
FRAMEWORKS = ("torch", "keras")


def sh(*cmd, timeout=600, check=True):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert res.returncode == 0, f"{shlex.join(cmd)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
    return res


@pytest.fixture(scope="module")
def image():
    return image_build.image()       # (a Docker daemon first, else skipped)


@pytest.fixture(scope="module")
def trainer_image(image):
    # Only the last layers differ: the user, its sshd config, the repository's owner.
    return image_build.build(f"{image}-{TRAINER}", f"--build-arg USER_NAME={TRAINER}", "--build-arg SSH_PORT=2222")


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


def comparisons(out):
    """A shell script: compare_digits.py of each framework in turn, as this machine runs it
    (tests/shared_launches.py), each one's JSON, log and exit status in `out`."""
    argv = shlex.join(["examples/compare_digits.py", *shared_launches.DIGITS_ARGS])
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in shared_launches.DIGITS_ENV.items())
    return "".join(f"{env} python {argv} --framework {fw} --json {out}/{fw}.json >{out}/{fw}.log 2>&1; "
                   f"echo $? >{out}/{fw}.code; " for fw in FRAMEWORKS)


@pytest.fixture(scope="module")
def digits_comparisons(image, tmp_path_factory):
    """Both frameworks' comparisons in one container and, while it runs, on this machine (the
    Keras one is test_examples_keras.py's, done already in a whole-suite session):
    {where: {framework: (exit status, JSON or None, log)}}."""
    out = tmp_path_factory.mktemp("digits")
    out.chmod(0o777)
    job = subprocess.Popen(docker_run(image, "bash", "-c", comparisons("/out"),
                                      options=("-v", f"{out}:/out")),
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        host = {fw: shared_launches.digits_comparison(tmp_path_factory, fw) for fw in FRAMEWORKS}
        log = job.communicate(timeout=len(FRAMEWORKS) * 2 * 900)[0]     # 2 runs each
    finally:
        job.kill()

    def read(path):
        return path.read_text() if path.is_file() else None

    return {"container": {fw: (int(read(out / f"{fw}.code") or -1),
                               json.loads(read(out / f"{fw}.json") or "null"),
                               (read(out / f"{fw}.log") or "") + log) for fw in FRAMEWORKS},
            "host": {fw: (code, json.loads(read(folder / "comparison.json") or "null"), text)
                     for fw, (code, text, folder) in host.items()}}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_digits_comparison_matches_make_run(digits_comparisons, framework):
    """compare_digits.py in the container and in this machine's .venv: the same seed, data
    order and float32 CPU kernels of the same torch release, so the same accuracies."""
    (code, got, log), (host_code, want, host_log) = (
        digits_comparisons[where][framework] for where in ("container", "host"))
    # Exit 0: both runs finished (--tolerance 100: no verdict on 1 epoch's gap); 2 a failed run.
    assert code == 0 and host_code == 0, (code, host_code, log, host_log)
    assert set(accuracies(got)) == {"sync", "default"}
    assert accuracies(got) == accuracies(want), (got, want)


def accuracies(comparison):
    return {run["label"]: run["accuracy"] for run in comparison["runs"]}


# ---- two containers, two nodes ----

def make_keys(d):
    """One key pair as the MPI Operator mounts it: id_rsa, id_rsa.pub, authorized_keys."""
    d.mkdir()
    sh("ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-f", str(d / "id_rsa"))
    (d / "authorized_keys").write_text((d / "id_rsa.pub").read_text())
    return d


@pytest.fixture
def keys(tmp_path):
    return make_keys(tmp_path / "ssh")


@pytest.fixture(scope="module")
def root_cluster(image, tmp_path_factory):
    """The root pair of containers, started once: the training test, then the kill test
    (which leaves node2 dead, so it comes last in this file)."""
    with Cluster(image, make_keys(tmp_path_factory.mktemp("root-keys") / "ssh"), "root") as cluster:
        yield cluster


class Cluster:
    """node1 and node2: one container each, host network, sshd on its own loopback address."""

    def __init__(self, image, keys, user):
        self.image, self.user = image, user
        self.home = "/root" if user == "root" else f"/home/{user}"
        if user != "root":                      # Kubernetes' fsGroup/defaultMode does this
            uid = int(sh("docker", "run", "--rm", image, "id", "-u").stdout)
            sh("chown", "-R", str(uid), str(keys))
        self.keys = keys
        self.port = PORT if user == "root" else PORT + 1    # the root pair may still be up
        self.names = {node: f"ph-{os.getpid()}-{user}-{node}" for node in NODES}

    def __enter__(self):
        # --add-host replaces the hosts file, which also named this machine (the containers'
        # hostname on the host network); Gloo looks its own name up.
        names = {**NODES, socket.gethostname(): "127.0.0.1"}
        hosts = [a for node, addr in names.items() for a in ("--add-host", f"{node}:{addr}")]
        config = [] if self.user == "root" else ["-f", f"{self.home}/.sshd_config"]
        for node, addr in NODES.items():
            sh("docker", "run", "-d", "--rm", "--network", "host", "--name", self.names[node],
               *hosts, "-v", f"{self.keys}:{self.home}/.ssh:ro", self.image,
               "/usr/sbin/sshd", "-De", *config, "-o", f"ListenAddress={addr}", "-p", str(self.port))
        deadline = time.monotonic() + 30
        for node in NODES:                       # sshd answers on both before anything starts
            while subprocess.run(["docker", "exec", self.names["node1"], "ssh", "-p", str(self.port),
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


def horovodrun(epochs, port):
    # --gloo: horovodrun would pick MPI (built in), which mpirun() below covers.
    return ["horovodrun", "--gloo", "-np", "2", "-H", "node1:1,node2:1", "-p", str(port),
            *digits(epochs)]


def mpirun(epochs, port):
    # Both "nodes" share this machine's loopback, which Open MPI's TCP transports skip unless told.
    return ["mpirun", "-np", "2", "-H", "node1:1,node2:1", "--mca", "plm_rsh_args", f"-p {port}",
            "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
            "--mca", "btl", "tcp,self", *digits(epochs)]


def train_on_both(cluster, user):
    for name, cmd in (("horovodrun", horovodrun(1, cluster.port)),
                      ("mpirun", mpirun(1, cluster.port))):
        res = subprocess.run(cluster.exec(*cmd), capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        assert res.returncode == 0, f"{name} as {user}:\n{out}"
        assert "size=2" in out and "ranks agree on the weights: True" in out, f"{name}:\n{out}"


@pytest.mark.parametrize("user", ["root", TRAINER])
def test_two_containers_train_as_two_nodes(request, user):
    if user == "root":
        train_on_both(request.getfixturevalue("root_cluster"), user)
        return
    keys = request.getfixturevalue("keys")
    with Cluster(request.getfixturevalue("trainer_image"), keys, user) as cluster:
        train_on_both(cluster, user)


def test_killed_node_stops_the_other_naming_the_lost_rank(root_cluster):
    cluster = root_cluster
    job = subprocess.Popen(cluster.exec(*horovodrun(50, cluster.port)), stdout=subprocess.PIPE,
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
