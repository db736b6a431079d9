"""Slurm for real: integrations/slurm/pipe_horovod.sbatch submitted with sbatch to a
two-node cluster on this machine (tests/slurm_cluster.py), as a user submits it.

- Each launcher the script offers trains the digits example with one rank on each
  node; every launcher, over either engine, ends at the same held-out accuracy.
- Bad input (an unknown launcher, too few nodes for the ranks, a checkpoint
  directory the nodes do not share) is one line in the job's output, before
  anything starts.
- Preemption: the USR1 of --signal=USR1@N makes every rank checkpoint at an
  agreed step with gradients in flight (K=2); the script requeues the job;
  later `scontrol requeue` (SIGTERM, then SIGKILL after KillWait) stops it
  again; the requeued job resumes each time and ends with weights
  bit-identical to an uninterrupted job's.
- The failure: a save the grace time cuts (rank 0's, blocked past KillWait) is said
  in the requeued job's output, and every rank resumes from the checkpoint before,
  ending bit-exact.
- Our Docker image in Slurm's own OCI containers (--container, runc): the script's
  torchrun launcher trains in the image on both nodes, to the same accuracy.
- A node lost mid-job (its link cut): the rank left names the node and its
  rank at the engine's timeout, and Slurm fails the job (last: it takes node2
  down until its link is back).

The script runs from the repository's venv (the one running these tests).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import image_build
import launcher
import slurm_cluster

REPO = launcher.REPO
SCRIPT = "integrations/slurm/pipe_horovod.sbatch"
SSH_SHIM = REPO / "tests" / "slurm_bin"      # `ssh` as a job step: the nodes run no sshd
REASON = slurm_cluster.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))

LAYOUT = ["--nodes=2", "--ntasks-per-node=1"]      # the machine's 2 cores: one rank per node
FINAL = re.compile(r"final held-out accuracy ([\d.]+)% after (\d+) epochs .*"
                   r"\(ranks agree on the weights: (\w+)\)")


@pytest.fixture(scope="session")
def cluster():
    c = slurm_cluster.SlurmCluster()
    try:
        c.start()
        print(f"\nSlurm cluster (slurmctld, slurmd on node1 and node2) up in "
              f"{c.start_seconds:.1f} s", flush=True)
        yield c
    finally:
        c.stop()


# Two epochs of 180 steps (4 images per rank per step): long enough to stop twice
# inside the first epoch, short next to the jobs' start.
FLAGS = ["--epochs", "2", "--batch-size", "4", "--pipeline-depth", "2"]


@pytest.fixture(scope="session")
def uninterrupted(cluster, tmp_path_factory):
    """The srun launcher's job with a checkpoint directory, run once: the srun case of the
    launcher test, and the uninterrupted run a requeued job must match bit for bit.
    (its output, the checkpoint directory)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    rc, log = submit(cluster, d / "job.out", script_args=FLAGS,
                     env=job_env("srun", CKPT_DIR=str(d / "ckpt")))
    assert rc == 0, f"srun job failed:\n{log[-4000:]}\n{cluster.logs()}"
    return log, d / "ckpt"


def job_env(launch=None, ssh=False, **extra):
    path = os.pathsep.join(([str(SSH_SHIM)] if ssh else []) + [os.path.dirname(sys.executable),
                                                               os.environ["PATH"]])
    env = {"PATH": path, **extra}
    if launch is not None:
        env["LAUNCH"] = launch
    return env


def submit(cluster, out, *sbatch_args, env, script_args=(), wait=True, timeout=180):
    """sbatch from the repository root on node1: the job id, or with `wait` (exit code,
    the job's output) once it ended (polled: `sbatch --wait` polls every 2 to 10 s)."""
    argv = ["sbatch", "--parsable", f"--output={out}", *LAYOUT, *sbatch_args, SCRIPT,
            *script_args]
    res = cluster.run(argv, env=env, cwd=REPO, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    job = res.stdout.strip().split(";")[0]
    if not wait:
        return job
    fields = wait_for(cluster, job, lambda f: f["JobState"] in ENDED, timeout)
    log = Path(out).read_text() if Path(out).exists() else ""
    return int(fields["ExitCode"].split(":")[0]), log


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def job_fields(cluster, job):
    out = cluster.run(["scontrol", "show", "job", "-o", job]).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def wait_for(cluster, job, predicate, timeout, log=None):
    """The job's fields once `predicate(fields)` holds; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(cluster, job)
        if predicate(fields):
            return fields
        if time.monotonic() > deadline:
            text = Path(log).read_text()[-3000:] if log and Path(log).exists() else ""
            raise AssertionError(f"job {job} still {fields.get('JobState')} after {timeout} s"
                                 f"\n{text}\n{cluster.logs()}")
        time.sleep(0.2)


def final(log):
    m = FINAL.search(log)
    assert m, f"no final accuracy in the job's output:\n{log[-3000:]}"
    return m


def test_sbatch_trains_on_two_nodes_with_each_launcher(cluster, uninterrupted, tmp_path):
    logs = {"srun": uninterrupted[0]}
    for launch in ("horovodrun", "torchrun"):
        rc, logs[launch] = submit(cluster, tmp_path / f"{launch}.out", script_args=FLAGS,
                                  env=job_env(launch, ssh=launch == "horovodrun"))
        assert rc == 0, f"{launch} job failed:\n{logs[launch][-4000:]}\n{cluster.logs()}"
    accuracy = {}
    for launch, log in logs.items():
        assert "ranks: 0 on node1, 1 on node2" in log, (launch, log[-3000:])
        engine = "torch" if launch == "torchrun" else "horovod"
        assert f"engine={engine} size=2 pipeline_depth=2" in log, (launch, log[-3000:])
        m = final(log)
        assert (m.group(2), m.group(3)) == ("2", "True"), (launch, m.group(0))
        accuracy[launch] = m.group(1)
    # One seed, one data order, one average of two gradients: the same accuracy
    # whichever launcher and engine ran it.
    assert len(set(accuracy.values())) == 1, accuracy


BAD_INPUT = {
    "launcher": ({"LAUNCH": "mpiexec"},
                 "pipe_horovod.sbatch: LAUNCH must be horovodrun, srun or torchrun, not 'mpiexec'"),
    "nodes": ({"LAUNCH": "srun", "NP": "4"},
              "pipe_horovod.sbatch: too few nodes for NP=4 ranks: the job has 2 node(s) x 1 "
              "rank(s) per node; submit with --nodes=4"),
    "checkpoint": ({"LAUNCH": "srun", "CKPT_DIR": "{scratch}/ckpt"},
                   "pipe_horovod.sbatch: CKPT_DIR={scratch}/ckpt is not shared between the "
                   "nodes: node2 cannot see the file node1 wrote there (put it on shared "
                   "storage)"),
    "container launcher": ({"LAUNCH": "srun", "CONTAINER": "{scratch}"},
                           "pipe_horovod.sbatch: CONTAINER runs with LAUNCH=torchrun only, not "
                           "'srun': Slurm gives a container no SLURM_PROCID, so only "
                           "torchrun's rendezvous numbers the ranks"),
    "container bundle": ({"LAUNCH": "torchrun", "CONTAINER": "{scratch}"},
                         "pipe_horovod.sbatch: CONTAINER={scratch} is not an OCI bundle (no "
                         "config.json)"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_sbatch_bad_input_is_one_line_before_training(cluster, tmp_path, case):
    variables, line = BAD_INPUT[case]
    variables = {k: v.format(scratch=cluster.scratch) for k, v in variables.items()}
    rc, log = submit(cluster, tmp_path / "job.out", env=job_env(**variables),
                     script_args=["--epochs", "1"])
    assert rc != 0, log
    assert line.format(scratch=cluster.scratch) in log.splitlines(), log
    # Nothing ran: not the environment check, not a rank.
    assert "engines:" not in log and "digits:" not in log, log


# --- preemption and requeue ----------------------------------------------------------

# (A rank the signal reaches after the others agreed to stop says "another rank's signal".)
SAVED = re.compile(r"^rank (\d): (SIG\w+|another rank's signal): checkpoint at epoch (\d+) "
                   r"step (\d+) saved", re.M)


def wait_in_log(path, pattern, count, timeout=240, cluster=None, job=None):
    """The `count`-th match of `pattern` in the job's output, waited for; a timeout says
    where the job and the nodes are (with `cluster` and `job`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = Path(path).read_text() if Path(path).exists() else ""
        found = list(re.finditer(pattern, text, re.M))
        if len(found) >= count:
            return found[count - 1]
        if time.monotonic() > deadline:
            where = "" if cluster is None else (
                f"\njob {job}: {job_fields(cluster, job)}\nnodes: {cluster.node_states()}"
                f"\n{cluster.logs()}")
            raise AssertionError(f"no {pattern!r} #{count} in:\n{text[-3000:]}{where}")
        time.sleep(0.05)


def back_in_queue(cluster, job, restarts, out):
    """Waits until the job is back in the queue: it starts again by itself once the killed
    run's credential expires (slurm_cluster.CRED_EXPIRE s after the requeue)."""
    wait_for(cluster, job, lambda f: f["JobState"] == "PENDING"
             and int(f["Restarts"]) == restarts, 60, out)


def checkpoints(log, signal_name):
    """(epoch, step) at which both ranks saved on `signal_name`: a rank names it, and
    every rank saved at that step (the signal reaches each rank in turn: a later one may
    stop on the others' agreement first)."""
    saved = [(int(m[1]), m[2], (int(m[3]), int(m[4]))) for m in SAVED.finditer(log)]
    at = {where for _, why, where in saved if why == signal_name}
    assert len(at) == 1, (signal_name, saved, log[-3000:])
    where = at.pop()
    assert {rank for rank, _, w in saved if w == where} == {0, 1}, (signal_name, saved,
                                                                    log[-3000:])
    return where


def assert_bit_exact(torch, run_dir, ref_dir):
    """Each rank's last checkpoint in `run_dir` is past the last epoch and holds, tensor
    for tensor, the weights of the uninterrupted job's in `ref_dir`."""
    for rank in range(2):
        got = torch.load(run_dir / f"digits.{rank}.pt", weights_only=False)
        want = torch.load(ref_dir / f"digits.{rank}.pt", weights_only=False)
        assert (got["epoch"], want["epoch"]) == (3, 3)       # both past their last epoch
        for name, tensor in want["model"].items():
            assert torch.equal(got["model"][name], tensor), f"rank {rank}: {name} differs"


def test_preempted_job_requeued_resumes_bit_exact(cluster, uninterrupted, tmp_path):
    torch = pytest.importorskip("torch")
    ref_log, ref_dir = uninterrupted
    run_dir = tmp_path / "ckpt"
    out = tmp_path / "preempted.out"
    job = submit(cluster, out, "--requeue", "--signal=USR1@60", "--open-mode=append",
                 script_args=FLAGS, env=job_env("srun", CKPT_DIR=str(run_dir)), wait=False)
    # 1. What --signal=USR1@60 sends 60 s before the time limit, sent as training starts:
    # every rank checkpoints at one step, and the script requeues the job.
    on = {"cluster": cluster, "job": job}
    wait_in_log(out, r"^digits: ", 1, **on)
    cluster.run(["scancel", "--signal=USR1", job])
    wait_in_log(out, r"^pipe_horovod.sbatch: stopped at a checkpoint \(epoch \d+ step \d+\): "
                     rf"requeueing job {job}$", 1, **on)
    first = checkpoints(Path(out).read_text(), "SIGUSR1")
    back_in_queue(cluster, job, 1, out)
    wait_in_log(out, rf"^resumed from {run_dir}: epoch {first[0]} step {first[1]}$", 1, **on)

    # 2. Requeued by the scheduler (an operator, a preemption) as the resumed run trains:
    # SIGTERM to every task, SIGKILL KillWait seconds later.
    wait_in_log(out, r"^digits: ", 2, **on)
    cluster.run(["scontrol", "requeue", job])
    back_in_queue(cluster, job, 2, out)
    second = checkpoints(Path(out).read_text(), "SIGTERM")
    wait_in_log(out, rf"^resumed from {run_dir}: epoch {second[0]} step {second[1]}$", 1,
                **on)
    fields = wait_for(cluster, job, lambda f: f["JobState"] in ENDED, 120, out)
    log = Path(out).read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]

    # Both stops inside the first epoch, after its first step (a stop takes one step to
    # agree on): with K=2 a gradient was in flight at each (the epoch-end flush is later).
    assert first[0] == second[0] == 1 and 0 < first[1] < second[1], (first, second)
    assert final(log).group(1) == final(ref_log).group(1)
    assert_bit_exact(torch, run_dir, ref_dir)


def test_a_save_the_grace_time_cuts_resumes_from_the_previous_checkpoint(cluster, uninterrupted,
                                                                         tmp_path):
    """The failure: rank 0's save outlasts the grace time (KillWait) and is killed, rank 1's
    completes. Rank 0's save goes to a FIFO nobody reads, so it blocks as a large model's
    save on slow storage would. The requeued job says so, every rank resumes from the
    checkpoint before (the first epoch's end: rank 1 goes back to it), and the job ends
    bit-exact against the uninterrupted one: nothing else is lost."""
    torch = pytest.importorskip("torch")
    ref_log, ref_dir = uninterrupted
    run_dir = tmp_path / "ckpt"
    out = tmp_path / "cut.out"
    job = submit(cluster, out, "--requeue", "--open-mode=append", script_args=FLAGS,
                 env=job_env("srun", CKPT_DIR=str(run_dir)), wait=False)
    on = {"cluster": cluster, "job": job}
    wait_in_log(out, r"^epoch +1/2 ", 1, **on)          # rank 0 prints it after its save
    deadline = time.monotonic() + 60
    while not (run_dir / "digits.1.pt").exists():        # and rank 1 has saved as well
        assert time.monotonic() < deadline, "rank 1 saved no checkpoint after the first epoch"
        time.sleep(0.05)
    os.mkfifo(run_dir / "digits.0.pt.tmp")
    cluster.run(["scontrol", "requeue", job])
    back_in_queue(cluster, job, 1, out)
    wait_in_log(out, r"^rank 0: the previous run was killed while it saved its checkpoint "
                     r"\(a grace time shorter than the save\?\): resuming from the last "
                     r"complete one$", 1, **on)
    wait_in_log(out, rf"^resumed from {run_dir}: epoch 2 step 0$", 1, **on)
    fields = wait_for(cluster, job, lambda f: f["JobState"] in ENDED, 120, out)
    log = Path(out).read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    # Rank 1 saved at the stop, inside the second epoch, and went back from there.
    saved = re.search(r"^rank 1: SIGTERM: checkpoint at epoch 2 step (\d+) saved", log, re.M)
    assert saved and int(saved[1]) > 0, log[-4000:]
    assert (f"rank 1: another rank's last save was cut short: resuming from epoch 2 step 0, "
            f"the newest every rank saved, not from its own newest (epoch 2 step {saved[1]})"
            ) in log, log[-4000:]
    assert "rank 0: SIGTERM: checkpoint" not in log, log[-4000:]
    assert final(log).group(1) == final(ref_log).group(1)
    assert_bit_exact(torch, run_dir, ref_dir)


# --- our image in Slurm's OCI containers ---------------------------------------------

def oci_bundle(cluster, image, path):
    """An OCI bundle of `image` at `path` on both nodes, as a site makes one (umoci,
    `docker export`): the image's layers are its rootfs, an overlay each node mounts in
    its own mount namespace (the writes that runc's mount points need stay on the node;
    the container sees it read-only). As Slurm's containers must, it shares the node's
    network (and its hostname and /etc/hosts); /tmp, where the job writes, is bound.
    Returns a function that unmounts it."""
    driver = json.loads(subprocess.run(["docker", "image", "inspect", image], check=True,
                                       capture_output=True, text=True).stdout)[0]["GraphDriver"]
    if driver["Name"] != "overlay2":
        pytest.skip(f"Docker's storage driver is {driver['Name']}, not overlay2: its layers "
                    "are no overlay's lower directories")
    layers = [driver["Data"].get("UpperDir"), *(driver["Data"].get("LowerDir") or "").split(":")]
    (path / "rootfs").mkdir(parents=True)
    subprocess.run(["runc", "spec", "-b", str(path)], check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["root"] = {"path": "rootfs", "readonly": True}
    spec.pop("hostname")
    spec["process"]["terminal"] = False
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"]
                                   if n["type"] not in ("network", "uts")]
    spec["mounts"] += [{"destination": "/tmp", "type": "bind", "source": "/tmp",
                        "options": ["rbind", "rw"]},
                       {"destination": "/etc/hosts", "type": "bind", "source": "/etc/hosts",
                        "options": ["bind", "ro"]}]
    (path / "config.json").write_text(json.dumps(spec))
    for node, name in enumerate(slurm_cluster.NODES):
        upper, work = path / f"{name}-upper", path / f"{name}-work"
        upper.mkdir()
        work.mkdir()
        options = f"lowerdir={':'.join(filter(None, layers))},upperdir={upper},workdir={work}"
        cluster.run(cluster.in_mounts_of(node, ["mount", "-t", "overlay", "overlay", "-o",
                                                options, str(path / "rootfs")]))

    def unmount():
        for node in range(len(slurm_cluster.NODES)):
            cluster.run(cluster.in_mounts_of(node, ["umount", str(path / "rootfs")]),
                        check=False)
    return unmount


def test_sbatch_runs_our_image_in_slurm_oci_containers(cluster, uninterrupted, tmp_path):
    if shutil.which("runc") is None:
        pytest.skip("no runc, the OCI runtime Slurm's --container calls (Debian: runc)")
    image = image_build.image()
    bundle = tmp_path / "bundle"
    unmount = oci_bundle(cluster, image, bundle)
    try:
        # Each node's task runs in the image: its Python and its pipe_horovod (the tasks
        # get srun's environment: no PYTHONPATH of this suite's, as the script does).
        res = cluster.run(["env", "-u", "PYTHONPATH", "srun", *LAYOUT, f"--container={bundle}",
                           "/opt/venv/bin/python",
                           "-c", "import socket, sys, pipe_horovod; print(socket.gethostname(), "
                           "sys.prefix, pipe_horovod.__file__.startswith(sys.prefix))"],
                          timeout=120)
        assert sorted(filter(None, res.stdout.splitlines())) == [
            f"{node} /opt/venv True" for node in slurm_cluster.NODES], res.stdout + res.stderr
        out = tmp_path / "container.out"
        rc, log = submit(cluster, out, script_args=FLAGS,
                         env=job_env("torchrun", CONTAINER=str(bundle)))
    finally:
        unmount()
    assert rc == 0, f"container job failed:\n{log[-4000:]}\n{cluster.logs()}"
    assert "ranks: 0 on node1, 1 on node2" in log, log[-3000:]
    assert "engine=torch size=2 pipeline_depth=2" in log, log[-3000:]
    m = final(log)
    assert (m.group(2), m.group(3)) == ("2", "True"), m.group(0)
    # The image's torch and pipe_horovod, the same seed and data: the host's accuracy.
    assert m.group(1) == final(uninterrupted[0]).group(1), (m.group(0), final(uninterrupted[0]))


# --- a node lost mid-job (last: it takes node2 down) ---------------------------------

ENGINE_TIMEOUT = 15      # PIPE_HOROVOD_TIMEOUT for this job: how long a wait may block


def test_lost_node_fails_the_job_naming_node_and_rank(cluster, tmp_path):
    out = tmp_path / "lost.out"
    job = submit(cluster, out, "--no-requeue", script_args=["--epochs", "25", *FLAGS[2:]],
                 env=job_env("srun", PIPE_HOROVOD_TIMEOUT=str(ENGINE_TIMEOUT)), wait=False)
    wait_in_log(out, r"^digits: ", 1)
    cut = time.monotonic()
    cluster.set_link(1, up=False)
    try:
        fields = wait_for(cluster, job, lambda f: f["JobState"] in ENDED, 120, out)
        ended = time.monotonic() - cut
    finally:
        cluster.set_link(1, up=True)
    log = Path(out).read_text()
    # The last: the first is the chained cause, before the diagnosis was added.
    errors = re.findall(r"^pipe_horovod\.engine\.faults\.WaitTimeoutError: .*$", log, re.M)
    assert errors, log[-4000:]
    error = errors[-1]
    # Rank 0, on node1, names what it waited for, and node2 with its rank.
    assert f"did not complete within {ENGINE_TIMEOUT} s" in error, error
    assert error.endswith("; rank 1 on node2 cannot be checked from here"), error
    # Slurm ends the job as failed and gives its nodes back.
    assert fields["JobState"] in ("FAILED", "NODE_FAIL"), (fields["JobState"], log[-3000:])
    assert "final held-out accuracy" not in log
    print(f"\nlink cut: job {fields['JobState']} after {ended:.0f} s "
          f"(engine timeout {ENGINE_TIMEOUT} s)", flush=True)
