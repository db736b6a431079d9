"""The GPU check's steps, run one after another by build/gpu-kit/run.sh (docs/gpu.md).

A GPU machine is lent rarely and briefly, so everything it runs is prepared here: each
step launches real workers the way users do (plain python, horovodrun, torchrun) with
the kit's Horovod builds, under its own time limit and within the call's budget; a step
that fails, hangs or crashes is marked and the next one runs. After every step the
report is written again (report.md, report.json, logs.txt in --out), so a call cut short
still brings back what ran.

With --no-gpu (the rehearsal, tests/test_gpu_kit.py) the steps that have a CPU form run
it on CPU tensors, smaller; the ones that need a GPU are skipped with the reason.

    python tests/gpu_kit/checks.py --out DIR --kit build/gpu-kit --site SITE [--no-gpu]
        [--budget SECONDS] [--steps a,b,...]
"""
import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS))
import launcher  # noqa: E402

RESERVE_S = 15          # kept back from the budget: the report's last write, the call's exit
STATUSES = ("PASS", "FAIL", "TIMEOUT", "RECORDED", "SKIP")


@dataclasses.dataclass
class Result:
    status: str                                   # one of STATUSES
    summary: list                                 # markdown lines for the report
    data: dict = dataclasses.field(default_factory=dict)
    log: str = ""


class Context:
    """What every step needs: the device, the kit's installed parts, the time left."""

    def __init__(self, out, kit, site, no_gpu, budget_s):
        self.out, self.kit, self.site = Path(out), Path(kit), Path(site)
        self.no_gpu = no_gpu
        self.device = "cpu" if no_gpu else "cuda"
        self.deadline = time.monotonic() + budget_s
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu-kit-steps-"))
        self.machine = {}                         # what step_machine found

    def left(self):
        return self.deadline - time.monotonic() - RESERVE_S

    def env(self, horovod="nccl", **extra):
        """The environment of a step's processes: one of the kit's Horovod builds ("nccl",
        "cpu") first on PYTHONPATH and PATH, the common wheels, the prebuilt kernels."""
        env = dict(os.environ)
        paths = [str(self.site / f"horovod-{horovod}"), str(self.site / "common")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "")
                                                     .split(os.pathsep) if p])
        env["PATH"] = os.pathsep.join([str(self.site / f"horovod-{horovod}" / "bin"),
                                       env.get("PATH", "")])
        kernels = self.kit / "lib" / "pipe_horovod_kernels.so"
        if kernels.is_file():
            env["PIPE_HOROVOD_NATIVE_LIBRARY"] = str(kernels)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, cmd, env, limit_s):
        """(exit code or None on timeout, output, seconds) of `cmd` in its own process group,
        killed with its children at min(limit_s, the time left); the rehearsal's 2 cores
        get three times the GPU machine's limits."""
        timeout = max(1.0, min(limit_s * (3 if self.no_gpu else 1), self.left()))
        started = time.monotonic()
        try:
            code, out = launcher.run_command(cmd, 1, timeout=timeout, env=env, expect_ok=False)
        except AssertionError as timed_out:       # launcher's timeout carries the output
            return None, str(timed_out), time.monotonic() - started
        return code, out, time.monotonic() - started


def horovodrun(np_, argv):
    """`horovodrun -np N -H localhost:N --gloo` of the build on PYTHONPATH (its console
    script's module, so the kit's build runs whatever bin/ pip wrote)."""
    return [sys.executable, "-m", "horovod.runner.launch", "-np", str(np_), "-H",
            f"localhost:{np_}", "--gloo", sys.executable, *map(str, argv)]


def torchrun(np_, argv):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(np_), *map(str, argv)]


def marker(out, word):
    """The JSON after `word ` on the first line that has it, or None."""
    for line in out.splitlines():
        at = line.find(word + " ")
        if at >= 0:
            try:
                return json.loads(line[at + len(word) + 1:])
            except ValueError:
                return None
    return None


def finished(code, out, np_):
    """Whether a launch exited 0 with WORKER_OK from every rank."""
    return code == 0 and launcher.ranks_saying(out, launcher.OK) == set(range(np_))


def outcome(code, ok):
    return "TIMEOUT" if code is None else "PASS" if ok else "FAIL"


# ----------------------------------------------------------------------------- steps

def step_machine(ctx):
    probe = r"""
import json, os, platform, shutil, subprocess, torch
from pipe_horovod.tools.emulate import unavailable_reason
info = {"python": platform.python_version(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cpus": os.cpu_count(),
        "gpu": None, "nccl": None, "driver": None,
        "emulation": unavailable_reason() or "available"}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                   "memory_gib": round(p.total_memory / 2**30, 1),
                   "count": torch.cuda.device_count()}
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
if shutil.which("nvidia-smi"):
    res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    info["driver"] = res.stdout.strip() or None
print("MACHINE " + json.dumps(info))
"""
    code, out, _ = ctx.run([sys.executable, "-c", probe], ctx.env(), 120)
    info = marker(out, "MACHINE")
    if info is None:
        return Result(outcome(code, False), ["the probe printed nothing"], log=out)
    gpu = info["gpu"]
    lines = [f"{gpu['name']} (compute capability {gpu['capability']}, {gpu['memory_gib']} GiB"
             f"{', ' + str(gpu['count']) + ' GPUs' if gpu['count'] > 1 else ''}), driver "
             f"{info['driver']}, NCCL {info['nccl']}" if gpu else "no GPU (CPU rehearsal)",
             f"Python {info['python']}, torch {info['torch']} (CUDA {info['cuda']}), "
             f"{info['cpus']} CPUs",
             f"emulated links: {info['emulation']}"]
    ctx.machine = info
    return Result("PASS", lines, info, out)


# `horovodrun --check-build` in a process that has imported horovod.torch already: the
# check forks a process for each of its ten questions, and each then finds torch imported
# (on the rehearsal's two cores, 40 s a build instead of 4; the GPU machine runs the plain
# command).
CHECK_BUILD_PREIMPORTED = ("import runpy, sys, horovod.torch; sys.argv[1:] = ['--check-build']; "
                           "runpy.run_module('horovod.runner.launch', run_name='__main__')")


def step_horovod_build(ctx):
    lines, data, ok, text = [], {}, True, ""
    cmd = ([sys.executable, "-c", CHECK_BUILD_PREIMPORTED] if ctx.no_gpu else
           [sys.executable, "-m", "horovod.runner.launch", "--check-build"])
    for build, want_nccl in (("nccl", True), ("cpu", False)):
        code, out, _ = ctx.run(cmd, ctx.env(build), 90)
        marks = {name: mark for mark, name in re.findall(r"\[(X| )\] (\w[\w ]*?)\s*$", out,
                                                         re.M)}
        got = {name: marks.get(name) == "X" for name in ("PyTorch", "Gloo", "NCCL", "MPI")}
        good = code == 0 and got["PyTorch"] and got["Gloo"] and got["NCCL"] == want_nccl
        ok &= good
        data[build] = got
        lines.append(f"the {build.upper()}-ops build: " + ", ".join(
            f"{name} {'yes' if has else 'no'}" for name, has in got.items())
            + ("" if good else f" (expected NCCL {'yes' if want_nccl else 'no'})"))
        text += out
        if code is None:
            return Result("TIMEOUT", lines, data, text)
    return Result("PASS" if ok else "FAIL", lines, data, text)


# The rehearsal's trainings are 8 steps, not 20: still 5 pipelined after warm-up 3 at K=3,
# enough to show the kit runs the oracle (the suite checks the math on CPU tensors).
REHEARSAL_ORACLE_STEPS = 8
ORACLE_CASES = ("24 trainings (MLP and CNN, SGD with momentum and Adam, K = 1, 2, 3, "
                "warm-up 0 and 3) equal the oracle within rounding")


def _oracle(ctx, cmd, np_, horovod, extra=None, what=""):
    """optimizer_worker's oracle case. One rank runs plain Pipe-SGD: there the default's
    prediction is exactly the next update, so the default runs as K=1 (applies each step
    at once) and only plain K >= 2 exercises the pipeline; two ranks run the default."""
    compensation = {"ORACLE_COMPENSATION": "lookahead"} if np_ > 1 else {}
    steps = {"ORACLE_STEPS": REHEARSAL_ORACLE_STEPS} if ctx.no_gpu else {}
    env = ctx.env(horovod, ORACLE_DEVICE=ctx.device, **compensation, **steps, **(extra or {}))
    code, out, seconds = ctx.run(cmd, env, 150)
    ok = finished(code, out, np_)
    lines = [f"{np_} rank(s) on {'cuda' if ctx.device == 'cuda' else 'CPU'} tensors{what}, "
             f"{'the default staleness compensation' if np_ > 1 else 'plain Pipe-SGD'}: "
             + (ORACLE_CASES if ok else "did not finish cleanly (log below)")]
    nccl = re.search(r"NCCL INFO NCCL version ([\w.+-]+)", out)
    if nccl:
        lines.append(f"NCCL {nccl.group(1)} initialised by Horovod (its ops carried the "
                     "reductions)")
    return Result(outcome(code, ok), lines, {"seconds": round(seconds, 1)}, out)


WORKER = TESTS / "workers" / "optimizer_worker.py"


def step_oracle_local(ctx):
    return _oracle(ctx, [sys.executable, WORKER, "oracle"], 1, "nccl", what=", engine local")


def step_oracle_horovod_nccl(ctx):
    extra = {} if ctx.no_gpu else {"NCCL_DEBUG": "INFO"}
    return _oracle(ctx, horovodrun(1, [WORKER, "oracle"]), 1, "nccl", extra,
                   ", engine horovod (the NCCL-ops build, horovodrun -np 1)")


def step_two_ranks_torch(ctx):
    return _oracle(ctx, torchrun(2, [WORKER, "oracle"]), 2, "nccl",
                   {"ORACLE_TORCH_BACKEND": "gloo"},
                   " sharing the GPU, engine torch over a gloo group (torchrun)")


def step_two_ranks_horovod(ctx):
    return _oracle(ctx, horovodrun(2, [WORKER, "oracle"]), 2, "cpu",
                   what=" sharing the GPU, engine horovod (the CPU-ops build copies CUDA "
                        "tensors through the host; horovodrun --gloo)")


def step_nccl_shared(ctx):
    probe = TESTS / "gpu_kit" / "nccl_probe.py"
    lines, data, text = [], {}, ""
    for name, cmd, build in (
            ("torch.distributed NCCL backend (torchrun)",
             torchrun(2, [probe, "--engine", "torch"]), "nccl"),
            ("Horovod's NCCL ops (horovodrun)",
             horovodrun(2, [probe, "--engine", "horovod"]), "nccl")):
        code, out, seconds = ctx.run(cmd, ctx.env(build, NCCL_DEBUG="WARN"), 45)
        said = sorted(set(re.findall(r"NCCL_PROBE (.*)", out)))
        warn = [ln.strip() for ln in out.splitlines() if "NCCL WARN" in ln][:2]
        if code is None:
            said.append(f"no answer in {seconds:.0f} s (killed)")
        data[name] = {"exit": code, "said": said, "nccl_warnings": warn}
        lines.append(f"{name}: " + "; ".join(said + warn or ["no output"]))
        text += out
    return Result("RECORDED", lines, data, text)


def step_codecs(ctx):
    size = [] if not ctx.no_gpu else ["--mib", "4", "--reps", "2"]
    code, out, _ = ctx.run([sys.executable, TESTS / "gpu_kit" / "codecs.py", "--device",
                            ctx.device, *size], ctx.env(), 180)
    res = marker(out, "CODECS")
    if res is None:
        return Result(outcome(code, False), ["the codec check printed no result"], log=out)
    ok = code == 0 and not res["mismatches"]
    lines = [f"{res['compared']} intermediates of two-stage reductions over {res['ranks']} "
             f"simulated ranks ({', '.join(res['kinds'])}; sizes "
             f"{', '.join(map(str, res['sizes']))}) and of per-hop codecs on {res['device']} "
             + ("equal the CPU reference bit for bit" if ok else
                f"differ in {len(res['mismatches'])}: {'; '.join(res['mismatches'][:8])}"),
             f"GB/s of float32 input on {res['device']} ({res['native']}), {res['mib']} MiB "
             "(per hop: one 4 MiB chunk a call):",
             "", "| codec | " + " | ".join(["first stage / encode", "second stage / decode_add",
                                             "decode / decode_into"]) + " |",
             "|---|---:|---:|---:|"]
    for kind, stages in res["gbps"].items():
        values = list(stages.values()) + [""] * (3 - len(stages))
        lines.append(f"| {kind} | " + " | ".join(map(str, values)) + " |")
    return Result(outcome(code, ok), lines, res, out)


def step_keras_torch(ctx):
    env = ctx.env(KERAS_BACKEND="torch", TF_CPP_MIN_LOG_LEVEL="2")
    # The rehearsal: the plain cases only (tests/test_keras.py runs both on CPU tensors).
    modes = "oracle" if ctx.no_gpu else "oracle,staleness"
    code, out, _ = ctx.run([sys.executable, TESTS / "workers" / "keras_worker.py", modes],
                           env, 180)
    ok = finished(code, out, 1)
    device = re.search(r"KERAS_DEVICE (\S+) (\S+)", out)
    where = device.group(2) if device else "?"
    if ok and not ctx.no_gpu and not where.startswith("cuda"):
        ok = False
    lines = [f"Keras {device.group(1) if device else '?'} backend, variables on {where}: "
             + (f"fit equals the NumPy reference at K = 1, 2, 3, "
                f"{'plain' if ctx.no_gpu else 'plain and with lookahead'}"
                if ok else "did not pass (log below)")]
    return Result(outcome(code, ok), lines, {"variables_on": where}, out)


def _table(out):
    return [ln for ln in out.splitlines() if ln.startswith("|")]


# The fixed candidates auto chooses between on this path, beside it and the peers.
STEP_CONFIGS = ("horovod", "ddp", "ours-k1", "ours-k2", "ours-k2-int8eng", "ours-k2-int4eng:32",
                "ours-auto")
STEP_COLUMNS = ("config", "step ms", "IQR ms", "samples/s", "fwd+bwd ms", "exposed (wait) ms")


def _columns(table, names):
    """The markdown `table` (lines) with only the columns whose headers are in `names`."""
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table]
    keep = [i for i, head in enumerate(cells[0]) if head in names]
    return ["| " + " | ".join(row[i] for i in keep) + " |" for row in cells]


def _auto_lines(raw_json):
    """What tune="auto" logged in the benchmark (its decision and any trial's outcome)."""
    try:
        return json.loads(raw_json.read_text())["meta"].get("auto_lines") or []
    except (OSError, ValueError, KeyError):
        return []


def _bench_tables(text):
    """The benchmark report's tables: each a list of lines, in order."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def step_memory(ctx):
    if ctx.no_gpu:
        args = ["--device", "cpu", "--workers", "1", "--widths", "256", "--steps", "4"]
    else:
        args = ["--device", "cuda", "--model", "gpt2-small", "--steps", "4"]
    cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "memory", "--engines", "horovod",
           "--optimizers", "adamw", *args]
    code, out, _ = ctx.run(cmd, ctx.env(), 240)
    table = _table(out)
    ok = code == 0 and len(table) > 2
    what = ("torch.cuda.max_memory_allocated on GPT-2 small (124 M parameters), AdamW, one "
            "process (horovodrun -np 1, the NCCL-ops build), in units of the parameters' "
            "bytes:" if not ctx.no_gpu else "live tensors of a small MLP on CPU, AdamW, one "
            "process (horovodrun -np 1):")
    return Result(outcome(code, ok), [what, "", *table], {"table": table}, out)


def step_overhead(ctx):
    size = ["--steps", "3", "--rounds", "1"] if ctx.no_gpu else []
    lines, data, logs, codes = [], {}, "", []
    for precision, flags in (("fp32", []), ("bf16 autocast", ["--autocast", "bf16"])):
        code, out, _ = ctx.run([sys.executable, TESTS / "gpu_kit" / "overhead.py", "--device",
                                ctx.device, *size, *flags], ctx.env(), 180)
        logs += out
        codes.append(code)
        res = marker(out, "OVERHEAD")
        if res is None:
            lines += ["", f"{precision}: the overhead check printed no result"]
            continue
        data[precision] = res
        lines += [""] if lines else []
        lines += [f"one process, {res['model']} ({res['params'] / 1e6:.1f} M parameters), "
                  f"AdamW, {precision}, batch {res['batch'][0]} x {res['batch'][1]} tokens, "
                  f"{res['rounds']} rounds of {res['steps']} steps on {res['device']}:", "",
                  "| configuration | median step (ms) | vs plain torch |", "|---|---:|---:|"]
        lines += [f"| {name} | {row['median_ms']} | {row['vs_plain']:.3f}x |"
                  for name, row in res["configs"].items()]
        for name, decision in (res.get("auto") or {}).items():
            lines += ["", f"{name} decided: {json.dumps(decision)}"]
        if res["prediction_share_of_step"] is not None:
            lines += ["", f"K=2's extra pass (the lookahead's prediction) took "
                          f"{100 * res['prediction_share_of_step']:.1f}% of its step "
                          f"(median, {precision})."]
    ok = len(data) == 2 and all(code == 0 for code in codes)
    code = None if None in codes else max(codes)
    return Result(outcome(code, ok), lines, data, logs)


def step_profiles(ctx):
    size = ["--batch", "2", "--warmup", "1", "--iterations", "1"] if ctx.no_gpu else []
    code, out, _ = ctx.run([sys.executable, TESTS / "gpu_kit" / "profiles.py", "--device",
                            ctx.device, "--out", ctx.out, *size], ctx.env(), 150)
    res = marker(out, "PROFILES")
    if res is None:
        return Result(outcome(code, False), ["the profiles step printed no result"], log=out)
    lines = [f"each layer's forward and backward time on {res['device']} (medians), as replay "
             f"profiles for `pipe-horovod simulate --profile` (files beside this report):", "",
             "| model | batch | layers | step ms | forward ms | backward ms | file |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {m} | {r['batch']} | {r['layers']} | {r['step_ms']} | {r['forward_ms']} | "
              f"{r['backward_ms']} | {r['file']} |" for m, r in res["models"].items()]
    return Result(outcome(code, code == 0), lines, res, out)


def step_time(ctx):
    out_dir = ctx.scratch / "bench"
    if ctx.no_gpu:
        size = ["--model-mb", "2", "--steps", "3", "--warmup", "1", "--rounds", "1"]
    else:
        size = ["--model-mb", "50", "--batch-size", "64", "--steps", "10", "--warmup", "3",
                "--rounds", "3"]
    reason = ctx.machine.get("emulation", "the machine step did not run")
    base = [sys.executable, "-m", "pipe_horovod.tools.cli", "bench", "--engine", "horovod",
            "--workers", "2", "--device", ctx.device, "--model", "mlp", *size, "--configs",
            *STEP_CONFIGS, "--out", str(out_dir), "--no-progress"]
    # The rehearsal stays on loopback (tests/test_bench.py runs the emulated cluster).
    attempts = [("emulated 10 Gbit links", ["--emulate", "10gbit"])] \
        if reason == "available" and not ctx.no_gpu else []
    attempts.append(("loopback" if reason == "available" or ctx.no_gpu else
                     f"loopback (no emulated links: {reason})", []))
    text = ""
    for where, flags in attempts:
        # ours-auto decides after 5 measured steps, inside the run's warm-up and steps.
        code, out, _ = ctx.run(base + flags, ctx.env("cpu", PIPE_HOROVOD_TUNE_STEPS="5"), 240)
        text += out
        report = out_dir / "bench.md"
        if code == 0 and report.is_file():
            tables = _bench_tables(report.read_text())
            steps = next(t for t in tables if t[0].startswith("| config |"))
            ratios = next((t for t in tables if t[0].startswith("| ratio |")), [])
            table = _columns(steps, STEP_COLUMNS) + [""] + ratios
            png = out_dir / "bench.png"
            if png.is_file():
                shutil.copy(png, ctx.out / "step_time.png")
            decided = _auto_lines(out_dir / "bench-raw.json")
            lines = [f"2 ranks sharing the {'GPU' if not ctx.no_gpu else 'CPU'}, on {where}; "
                     f"the CPU-ops Horovod build (Horovod's optimizer and our engine); DDP "
                     f"over a gloo group beside it; medians of one run, side by side "
                     f"(step_time.png):", "", *table, "",
                     "ours-auto's own lines (rank 0):", "",
                     *(f"    {line}" for line in decided or ["(none logged)"])]
            return Result("PASS", lines, {"where": where, "table": table, "auto": decided},
                          text)
        if code is None:
            break
    return Result(outcome(code, False), ["the benchmark did not finish (log below)"], log=text)


STEPS = [
    # name, title, what it proves, needs a GPU (has no CPU form), function
    ("machine", "The machine", "what ran the check", False, step_machine),
    ("horovod-build", "Horovod's builds", "the kit's two Horovod wheels load on this Python "
     "and torch; `horovodrun --check-build` lists NCCL for the one and not the other",
     False, step_horovod_build),
    ("oracle-local", "CUDA oracle, one process", "the pipelined optimizer on CUDA tensors "
     "equals the single-process oracle at K=1 and at the default", False, step_oracle_local),
    ("oracle-horovod-nccl", "CUDA oracle on Horovod's NCCL ops", "the same through the "
     "horovod engine at size 1, its reductions on NCCL", False, step_oracle_horovod_nccl),
    ("two-ranks-torch", "Two ranks sharing the GPU: torch engine", "the oracle with CUDA "
     "tensors over gloo under torchrun", False, step_two_ranks_torch),
    ("two-ranks-horovod", "Two ranks sharing the GPU: horovod engine", "the oracle with CUDA "
     "tensors under horovodrun --gloo", False, step_two_ranks_horovod),
    ("nccl-shared", "NCCL with two ranks on one GPU", "what NCCL says, recorded", True,
     step_nccl_shared),
    ("codecs", "Codecs on CUDA", "the two-stage int8/int4/fp8 (and fp16/bf16) formats and the "
     "per-hop codecs give the CPU reference's bits on CUDA; their throughput", False,
     step_codecs),
    ("keras-torch", "Keras (torch backend) on CUDA", "Keras fit with the pipelined optimizer "
     "equals the NumPy reference, K=2 included, with variables on the GPU", False,
     step_keras_torch),
    ("memory", "Memory: GPT-2 small with AdamW", "torch.cuda.max_memory_allocated of "
     "Horovod's optimizer vs ours K=1, K=2 plain and the default", False, step_memory),
    ("overhead", "The wrapper's overhead in one process", "ours K=1, K=2 with the lookahead "
     "and the default (tune='auto') beside plain torch, and K=2's extra pass as a share of the "
     "step, in fp32 and under bf16 autocast", False, step_overhead),
    ("profiles", "Per-layer times", "each layer's forward and backward time of ResNet-50, "
     "BERT-base and GPT-2 small on the device, as replay profiles", False, step_profiles),
    ("step-time", "Step time, 2 ranks", "Horovod vs DDP vs ours K=1 and the default, side by "
     "side in one run", False, step_time),
]


# ---------------------------------------------------------------------------- report

def write_report(ctx, results, header):
    """report.json, report.md and logs.txt in ctx.out (each replaced whole)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    data = {**header, "steps": [{"name": n, "title": t, "proves": p, "status": r.status,
                                 "seconds": s, "summary": r.summary, "data": r.data}
                                for (n, t, p, r, s) in results]}
    md = [f"# GPU check, {header['date']}", "",
          f"Device: {header['device']}. Kit built for Python {header['kit']['python']}, torch "
          f"{header['kit']['torch']}, compute capability {header['kit']['cuda_cc']}, from "
          f"commit {header['kit']['commit']}"
          f"{' (with uncommitted changes)' if header['kit']['uncommitted_changes'] else ''}. "
          f"Command: `{header['command']}`{' (the rehearsal: no GPU)' if ctx.no_gpu else ''}.",
          "", "| step | status | seconds | what it proves |", "|---|---|---:|---|"]
    md += [f"| {t} | {r.status} | {s:.0f} | {p} |" for (n, t, p, r, s) in results]
    for (n, t, p, r, s) in results:
        md += ["", f"## {t} ({n}): {r.status}", "", *r.summary]
    logs = []
    for (n, t, p, r, s) in results:
        logs += [f"===== {n}: {r.status} ({s:.0f} s)", r.log[-20000:]]
    for name, text in (("report.json", json.dumps(data, indent=1)), ("report.md",
                       "\n".join(md) + "\n"), ("logs.txt", "\n".join(logs) + "\n")):
        tmp = ctx.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, ctx.out / name)


def run_steps(ctx, steps, header):
    """Each step in turn, the report rewritten after each; returns the results."""
    results = []
    for name, title, proves, needs_gpu, fn in steps:
        started = time.monotonic()
        if needs_gpu and ctx.no_gpu:
            result = Result("SKIP", ["needs a GPU (the rehearsal has none)"])
        elif ctx.left() < 20:
            result = Result("SKIP", ["no time left in the call's budget"])
        else:
            print(f"[gpu-kit] {name} ...", flush=True)
            try:
                result = fn(ctx)
            except Exception as exc:  # noqa: BLE001 - a broken step must not stop the others
                import traceback

                result = Result("FAIL", [f"the step raised {type(exc).__name__}: {exc}"],
                                log=traceback.format_exc())
        seconds = time.monotonic() - started
        print(f"[gpu-kit] {name}: {result.status} ({seconds:.0f} s)", flush=True)
        results.append((name, title, proves, result, seconds))
        write_report(ctx, results, header)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--kit", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--no-gpu", action="store_true")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all steps")
    parser.add_argument("--steps", default=None,
                        help="comma-separated step names (default: all, in order)")
    args = parser.parse_args(argv)
    steps = STEPS
    if args.steps:
        names = args.steps.split(",")
        unknown = sorted(set(names) - {s[0] for s in STEPS})
        if unknown:
            parser.error(f"unknown steps {unknown}; the steps: "
                         + ", ".join(s[0] for s in STEPS))
        steps = [s for s in STEPS if s[0] in names]
    ctx = Context(args.out, args.kit, args.site, args.no_gpu, args.budget)
    manifest = json.loads((Path(args.kit) / "manifest.json").read_text())
    header = {"format": "pipe_horovod.gpu-check/1",
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "device": "no GPU (rehearsal)" if args.no_gpu else _gpu_name(),
              "command": "bash build/gpu-kit/run.sh" + (" --no-gpu" if args.no_gpu else ""),
              "kit": {**manifest["target"], "commit": manifest["built"]["commit"],
                      "uncommitted_changes": manifest["built"]["uncommitted_changes"]}}
    try:
        results = run_steps(ctx, steps, header)
    finally:
        shutil.rmtree(ctx.scratch, ignore_errors=True)
    failed = [name for name, _, _, r, _ in results if r.status in ("FAIL", "TIMEOUT")]
    print(f"[gpu-kit] report: {Path(args.out) / 'report.md'}; "
          + (f"failed: {', '.join(failed)}" if failed else "no step failed"), flush=True)
    return 1 if failed else 0


def _gpu_name():
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return res.stdout.strip().replace("\n", ", ") or "a GPU (nvidia-smi named none)"
    except (OSError, subprocess.SubprocessError):
        return "a GPU (no nvidia-smi)"


if __name__ == "__main__":
    sys.exit(main())
