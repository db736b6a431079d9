"""What can be checked of the cluster files without Docker, Kubernetes or Slurm.

The Dockerfile through the official parser (PyPI `dockerfile`); the Kubeflow
manifests through PyYAML; the sbatch script by running it under bash with
Slurm's variables set and the launchers replaced by recorders. Every command
line they hold is then parsed by the real parser of what it runs (horovodrun,
torchrun, mpirun, the `pipe-horovod` CLI, the example's own argparse), so a
renamed example, flag or subcommand fails here.
"""
import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import launcher
from pipe_horovod import engine
from pipe_horovod.tools import cli

REPO = launcher.REPO
K8S = REPO / "integrations" / "kubernetes"
SLURM = REPO / "integrations" / "slurm" / "pipe_horovod.sbatch"
IMAGE_ROOT = "/opt/pipe_horovod"          # where the Dockerfile puts the repository


# ---- command lines, checked by the parsers of what they run ----

def check_example(argv):
    """`python examples/X.py FLAGS` or `examples/X.py FLAGS`: the file exists and its
    own parse_args accepts the flags."""
    if Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    script = REPO / argv[0]
    assert argv[0].startswith("examples/") and script.is_file(), f"no example {argv[0]!r}"
    try:
        example_module(script).parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"{script.name} rejects {argv[1:]}") from exc


@functools.cache
def example_module(script):
    spec = importlib.util.spec_from_file_location(f"example_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_horovodrun(argv):
    from horovod.runner import launch

    with mock.patch.object(sys, "argv", argv):
        try:
            args = launch.parse_args()
        except SystemExit as exc:
            raise AssertionError(f"horovodrun rejects {argv}") from exc
    check_example(args.command)


def check_torchrun(argv):
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"torchrun rejects {argv}") from exc
    check_example([args.training_script, *args.training_script_args])


def check_mpirun(argv):
    """The program after mpirun's options is the example; mpirun itself (when installed)
    accepts the options: it runs them here with `true` as the program."""
    program = argv.index("python")
    check_example(argv[program:])
    if shutil.which("mpirun"):
        res = subprocess.run([*argv[:program], *launcher.MPIRUN[1:], "true"], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, f"mpirun rejects {argv[:program]}: {res.stderr}"


def check_pipe_horovod(argv):
    parser, _ = cli.build_parser()
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"pipe-horovod rejects {argv}") from exc


CHECKS = {"horovodrun": check_horovodrun, "torchrun": check_torchrun, "mpirun": check_mpirun,
          "pipe-horovod": check_pipe_horovod, "python": check_example}


def check_command(argv):
    name = Path(argv[0]).name
    assert name in CHECKS, f"unexpected command {argv}"
    CHECKS[name](argv)


# ---- Kubernetes ----

def test_kubeflow_manifests_run_the_example():
    yaml = pytest.importorskip("yaml")
    mpijob = yaml.safe_load((K8S / "mpijob.yaml").read_text())
    assert (mpijob["apiVersion"], mpijob["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    specs = mpijob["spec"]["mpiReplicaSpecs"]
    launcher_cmd = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert launcher_cmd[0] == "mpirun"
    ranks = int(launcher_cmd[launcher_cmd.index("-np") + 1])
    assert ranks == specs["Worker"]["replicas"] * mpijob["spec"]["slotsPerWorker"]
    check_command(launcher_cmd)
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert worker["command"][0] == "/usr/sbin/sshd"    # the image installs openssh-server

    job = yaml.safe_load((K8S / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    for role in ("Master", "Worker"):
        container = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"     # the training operator's required name
        check_command(container["command"])
    # The operator's variables select the torch engine.
    assert engine.detect({"MASTER_ADDR": "m", "MASTER_PORT": "1", "RANK": "1",
                          "WORLD_SIZE": "2"}) == "torch"


# ---- Slurm ----

RECORDER = """#!/bin/bash
{ printf 'PIPE_HOROVOD_ENGINE=%s\\n' "${PIPE_HOROVOD_ENGINE:-}"; printf '%s\\n' "$(basename "$0")" "$@"; \
  printf '\\0\\n'; } >> "$RECORD"
"""
SCONTROL = """#!/bin/bash
[ "$*" = "show hostnames node[1-2]" ] && printf 'node1\\nnode2\\n'
"""


def run_sbatch(tmp_path, launch):
    """The sbatch script under bash, as Slurm would run it on 2 nodes x 4 tasks: (its
    exit code, its stderr, [(PIPE_HOROVOD_ENGINE, argv)] of every launcher it called)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("horovodrun", "srun", "torchrun", "pipe-horovod"):
        (bin_dir / name).write_text(RECORDER)
    (bin_dir / "scontrol").write_text(SCONTROL)
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    record = tmp_path / f"{launch}.calls"
    record.touch()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "LAUNCH": launch,
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_NTASKS": "8",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_ID": "77"}
    res = subprocess.run(["bash", str(SLURM)], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=30)
    calls = []
    for block in record.read_text().split("\0\n")[:-1]:
        first, *argv = block.splitlines()
        calls.append((first.split("=", 1)[1], argv))
    return res.returncode, res.stderr, calls


def test_sbatch_script_launches_the_example(tmp_path):
    assert subprocess.run(["bash", "-n", str(SLURM)]).returncode == 0
    pytest.importorskip("horovod.runner.launch")
    seen = {}
    for launch in ("horovodrun", "srun", "torchrun"):
        rc, err, calls = run_sbatch(tmp_path, launch)
        assert rc == 0, err
        check_pipe_horovod(calls[0][1])
        (engine_name, argv), = calls[1:]
        seen[launch] = argv
        if argv[0] == "srun":
            program = next(i for i, a in enumerate(argv) if i and not a.startswith("-"))
            argv = argv[program:]
        check_command(argv)
        if launch == "srun":     # nothing in srun's environment names the engine: the script does
            assert engine_name in engine.ENGINES and argv[0] == "python", (engine_name, argv)
    assert seen["horovodrun"][:5] == ["horovodrun", "-np", "8", "-H", "node1:4,node2:4"]
    torchrun = seen["torchrun"][seen["torchrun"].index("torchrun"):]
    assert torchrun[torchrun.index("--rdzv_endpoint") + 1] == "node1:29500"

    rc, err, calls = run_sbatch(tmp_path, "mpiexec")
    assert rc == 1 and "LAUNCH must be horovodrun, srun or torchrun, not 'mpiexec'" in err, err
    assert calls == []      # bad input is named before anything starts, the check included


# ---- Docker ----

def test_dockerfile_stages_arguments_and_files():
    dockerfile = pytest.importorskip("dockerfile")
    commands = dockerfile.parse_file(str(REPO / "Dockerfile"))
    froms = [c.value for c in commands if c.cmd == "FROM"]
    # A base the user picks; the build stage (compilers, nvcc) stays out of the image.
    assert froms == [("${BASE_IMAGE}", "AS", "system"), ("system", "AS", "build"),
                     ("system", "AS", "pipe-horovod")], froms

    defaults = {}           # every ARG's default: before the first FROM, or in its stage
    stage_args = set()      # ARGs declared in the stage being read
    for c in commands:
        if c.cmd == "FROM":
            stage_args = set()
        if c.cmd == "ARG":
            name, eq, default = c.value[0].partition("=")
            assert default or name in defaults, f"ARG {name} has no default (line {c.start_line})"
            assert not (eq and name in defaults), f"ARG {name}'s default given twice (line {c.start_line})"
            defaults.setdefault(name, default)
            stage_args.add(name)
        if c.cmd not in ("FROM", "ARG"):
            for arg in re.findall(r"\$\{(\w+)\}", " ".join([*c.value, *c.flags])):
                # ARGs declared before FROM are invisible inside the stage.
                assert arg in stage_args or arg == "PATH", f"${{{arg}}} undeclared in the stage (line {c.start_line})"
    for name, default in defaults.items():
        if name.endswith("_VERSION"):
            assert re.fullmatch(r"\d+(\.\d+)+", default), f"ARG {name}={default} is not pinned"
    for want in ("TORCH_VERSION", "TENSORFLOW_VERSION", "KERAS_VERSION", "HOROVOD_VERSION",
                 "USER_NAME", "CUDA_CC_LIST", "CUDA_VERSION", "BASE_IMAGE"):
        assert want in defaults, want
    # Versions `make` installs (constraints.txt): one truth for the image and CI.
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package, arg in (("torch", "TORCH_VERSION"), ("tensorflow-cpu", "TENSORFLOW_VERSION"),
                         ("keras", "KERAS_VERSION"), ("horovod", "HOROVOD_VERSION"),
                         ("scikit-learn", "SCIKIT_LEARN_VERSION")):
        assert pins.get(package) == defaults[arg], (package, pins.get(package), arg)
    assert f'HOROVOD_VERSION:-{defaults["HOROVOD_VERSION"]}' in (
        REPO / "scripts" / "install_horovod.sh").read_text()

    copied = set()          # repository paths under IMAGE_ROOT so far ("": all of it)
    for c in commands:
        if c.cmd == "COPY" and any(f.startswith("--from=") for f in c.flags):
            continue        # from a build stage (the prebuilt kernels), not the repository
        if c.cmd == "COPY":
            *sources, dest = c.value
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository (line {c.start_line})"
                if src == ".":
                    assert dest == IMAGE_ROOT, dest
                    copied.add("")
                    continue
                target = dest + Path(src).name if dest.endswith("/") else dest
                # The same layout as the repository: the scripts find each other by it.
                assert target == f"{IMAGE_ROOT}/{src}", (src, dest)
                copied.add(src)
        if c.cmd == "RUN":
            for used in re.findall(rf"{IMAGE_ROOT}/([\w./-]+)", c.value[0]):
                assert (REPO / used).is_file(), f"RUN uses {used}: not in the repository"
                assert used in copied or "" in copied, f"RUN uses {used} before a COPY puts it there"
            if "pip install" in c.value[0] and "--no-deps" not in c.value[0]:
                # pip reaches the index: through the CA check, with the CA a secret (no layer keeps it).
                assert "scripts/with_build_ca.sh" in c.value[0], f"pip without the CA (line {c.start_line})"
                assert "--mount=type=secret,id=ca" in c.flags, f"no CA secret (line {c.start_line})"
    run_text = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    for needed in ("scripts/install_horovod.sh", "horovodrun --check-build", "pipe-horovod check",
                   "HOROVOD_GPU_OPERATIONS=NCCL", "PIPE_HOROVOD_MPI=1", "pip check"):
        assert needed in run_text, needed
    check_pipe_horovod(shlex.split(re.search(r"pipe-horovod check[^&;]*", run_text).group(0)))
    assert [c.value for c in commands if c.cmd == "CMD"] == [("pipe-horovod", "check")]
    # The repository is the last thing copied, after the package's install and the user
    # options: a change outside the package rebuilds one layer, which runs nothing.
    assert [c.cmd for c in commands][-3:] == ["COPY", "USER", "CMD"] and commands[-3].value[0] == "."


# ---- the install scripts `make` and the image share ----

def run_script(name, env, path=None):
    full = {"PATH": path or os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **env}
    return subprocess.run([shutil.which("bash"), str(REPO / "scripts" / name)], env=full,
                          capture_output=True, text=True, timeout=120)


def bare_path(tmp_path, **scripts):
    """A PATH of coreutils' dirname plus `scripts` ({name: shell text}): no mpicc, no apt-get."""
    (tmp_path / "dirname").symlink_to(shutil.which("dirname"))
    for name, text in scripts.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / name).chmod(0o755)
    return str(tmp_path)


@pytest.mark.parametrize("env, error", [
    ({"PIPE_HOROVOD_MPI": "yes"}, "PIPE_HOROVOD_MPI must be 1, 0 or unset, not 'yes'"),
    ({"HOROVOD_GPU_OPERATIONS": "RCCL"}, "HOROVOD_GPU_OPERATIONS must be NCCL, MPI or GLOO"),
    ({"PIPE_HOROVOD_MPI": "1"}, "PIPE_HOROVOD_MPI=1 but no mpicc on PATH"),
    ({"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_BUILD_CUDA_CC_LIST": "70,90"},
     "compiles for compute capability 75 (Turing) and newer, not '70'"),
])
def test_install_horovod_refuses_bad_knobs(tmp_path, env, error):
    # The refusals come before Python is asked anything.
    res = run_script("install_horovod.sh", {"PYTHON": "false", **env}, path=bare_path(tmp_path))
    assert res.returncode == 1 and error in res.stderr, res.stderr


FAKE_PYTHON = """#!/bin/sh
# Answers install_horovod.sh's questions as a Python with torch $FAKE_TORCH would.
case "$*" in
  *torch.version.cuda*) echo "$FAKE_CUDA" ;;
  *torch.__version__*) echo "$FAKE_TORCH" ;;
  *version_info*) echo cp311 ;;
  *) exit 1 ;;
esac
"""


@pytest.mark.parametrize("torch_version, cuda, env, error", [
    ("2.13.0+cpu", "", {}, "needs a CUDA build of torch, but"),
    ("2.13.0+cu130", "13.0", {"PIPE_HOROVOD_CUDA_VERSION": "12.8"},
     "is built for CUDA 13.0, not the CUDA 12.8 asked for"),
    ("2.7.0+cu128", "12.8", {}, "set HOROVOD_CUDA_HOME to an installed CUDA 12.8 toolkit"),
])
def test_install_horovod_nccl_refuses_what_cannot_build(tmp_path, torch_version, cuda, env, error):
    """The NCCL build stops with one line, before fetching or compiling, when torch's CUDA
    is missing, is not the one asked for, or has no toolkit on PyPI this script assembles."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    res = run_script("install_horovod.sh", {
        "PYTHON": str(fake), "HOROVOD_GPU_OPERATIONS": "NCCL", "PIPE_HOROVOD_MPI": "0",
        "PIPE_HOROVOD_CACHE": str(tmp_path / "cache"), "FAKE_TORCH": torch_version,
        "FAKE_CUDA": cuda, **env})
    assert res.returncode == 1 and error in res.stderr, res.stdout + res.stderr
    assert not list((tmp_path / "cache").glob("**/*.whl")), "something was built"


@pytest.mark.parametrize("cc_list, problem", [
    ("75,80,86,89,90,100,120", ""), ("", ""), ("90", ""),
    ("70,90", "X=70,90: CUDA 13 compiles for compute capability 75 (Turing) and newer, not '70'"),
    ("75,sm_90", "X=75,sm_90: CUDA 13 compiles for compute capability 75 (Turing) and newer, "
                 "not 'sm_90'")])
def test_cuda_architectures_follow_one_rule(cc_list, problem):
    """scripts/cuda_archs.sh, which image.sh and install_horovod.sh both source."""
    res = subprocess.run([shutil.which("bash"), "-c", 'source scripts/cuda_archs.sh && '
                          'cuda_cc_problem X "$1"', "bash", cc_list], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == problem, res.stdout + res.stderr
    for script in ("image.sh", "install_horovod.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert "cuda_archs.sh" in text and "-ge 75" not in text, script


# ---- make image: what it refuses before building ----

def test_image_refuses_architectures_below_75():
    res = subprocess.run(["bash", str(REPO / "scripts" / "image.sh")], capture_output=True, text=True,
                         env={**os.environ, "CUDA_CC_LIST": "70,90"}, timeout=60)
    assert res.returncode == 1 and res.stderr.strip() == (
        "make image: CUDA_CC_LIST=70,90: CUDA 13 compiles for compute capability 75 (Turing) and "
        "newer, not '70'"), res.stdout + res.stderr


def test_docker_daemon_without_root_says_so(tmp_path):
    res = run_script("docker_daemon.sh", {}, path=bare_path(tmp_path, id="echo 1000"))
    assert res.returncode == 1 and res.stderr.strip() == (
        "no Docker daemon answers, and starting one needs root (or start Docker yourself)"), res.stderr


def test_dockerfile_refuses_a_base_with_old_python():
    """The system stage's check, run by an old Python (pyenv's) and by this one."""
    dockerfile = pytest.importorskip("dockerfile")
    old = sorted(Path.home().glob(".pyenv/versions/3.[6-9].*/bin/python3"))
    if not old:
        pytest.skip("no Python older than 3.10 under ~/.pyenv")
    run = next(c.value[0] for c in dockerfile.parse_file(str(REPO / "Dockerfile")) if c.cmd == "RUN")
    check = re.search(r'python3 -c "([^"]+)"', run).group(1)
    res = subprocess.run([str(old[-1]), "-c", check], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and re.fullmatch(
        r"BASE_IMAGE has Python 3\.\d; pipe_horovod needs 3\.10 or newer: use e\.g\. "
        r"debian:bookworm-slim, ubuntu:22\.04 or ubuntu:24\.04", res.stderr.strip()), res.stderr
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0


@pytest.fixture
def tls_index(tmp_path):
    """An HTTPS server on loopback with its own CA (a self-signed certificate): a TLS proxy."""
    import http.server
    import ssl
    import threading

    cert, key = tmp_path / "ca.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_port}/", cert
    server.shutdown()


def test_build_without_the_proxys_ca_says_what_to_pass(tls_index):
    url, ca = tls_index
    env = {"PIP_INDEX_URL": url, "PATH": os.environ["PATH"]}
    res = subprocess.run(["bash", str(REPO / "scripts" / "with_build_ca.sh"), "echo", "ran"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "fails verification" in res.stderr, res.stderr
    assert "docker build --secret id=ca,src=CA_BUNDLE" in res.stderr and "ran" not in res.stdout
    res = subprocess.run(["bash", str(REPO / "scripts" / "with_build_ca.sh"), "echo", "ran"],
                         env={**env, "PIP_CERT": str(ca)}, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "ran\n", res.stderr


def test_install_openmpi_without_root_leaves_it_out(tmp_path):
    res = run_script("install_openmpi.sh", {}, path=bare_path(tmp_path, id="echo 1000"))
    assert res.returncode == 0 and "Gloo controller only" in res.stdout, res.stdout + res.stderr
