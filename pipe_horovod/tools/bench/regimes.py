"""Three regimes side by side: where the network hides, where it matches compute, where it binds.

A user who switches the import must never lose, and must gain where the
network shows. One benchmark on one link cannot say both, so `pipe-horovod
bench --regimes` runs the same rows in three regimes on the emulated cluster,
under both engines, and puts them in one table per regime:

  compute-bound  a fast link (10 Gbit): communication a small part of a step
                 (comm ≤ 0.5 × compute);
  balanced       1 Gbit, compute set so that comm ≈ compute;
  network-bound  1 Gbit, compute set so that comm ≈ 6 × compute.

Compute is replayed (`pipe_horovod.tools.workloads.replay`: each layer's
forward and backward a timed wait, its gradients of the real sizes), as in
the replay rows of docs/results.md, so the ratio of communication to compute
is set, not hoped for: the replayed throughput of each regime follows from
the link's expected allreduce time (`expected_comm_s`) and the regime's
ratio. The run measures both (its `compute` and `allreduce` rows) and the
table says whether the ratio held (`REGIMES`' bands).

Rows (`configs_for`): the sync baseline (Horovod's optimizer under the
horovod engine; DDP under the torch engine, where Horovod cannot start), today's
default (`DEFAULT_ROW`: ours at K=2, what `DistributedOptimizer` gives
without arguments), each fixed candidate (`CANDIDATES`), the run that tunes
itself (`AUTO`) and, where the network binds, what a user would pick instead
(`PEERS`). Each row's step time is the median of its pooled two-step means
(`step_s`): a K=2 pipeline's steps may alternate, and a row whose depth is not
known in advance (auto) is read the same way as the others.

The targets (`check_targets`) are the run's promise: auto ≥ 0.97 × the best
fixed candidate and ≥ 0.98 × the sync baseline in every regime, and ahead
of each peer where the network binds.
"""
import dataclasses
import statistics

from pipe_horovod.tools.workloads import architectures

ENGINES = ("horovod", "torch")
BASELINE = {"horovod": "horovod", "torch": "ddp"}
BASELINE_LABEL = {"horovod": "Horovod", "torch": "DDP"}
DEFAULT_ROW = "ours-k2"
CANDIDATES = ("ours-k1", "ours-k2", "ours-k2-bf16", "ours-k2-int8eng", "ours-k2-int4eng:32")
AUTO = "ours-auto"
PEERS = ("horovod-fp16", "ddp-powersgd", "ddp-bf16")
MEASURES = ("compute", "allreduce")

# The run's promise (see the module doc): (what, threshold).
AUTO_VS_BEST = 0.97
AUTO_VS_BASELINE = 0.98
AUTO_VS_PEER = 1.0

# Horovod's gloo allreduce of 64 MiB on a 1 Gbit emulated link took 571 ms on this
# machine (docs/results.md, collectives): 0.94 of the capped rate; smaller messages
# and the torch engine do a little worse.
LINK_EFFICIENCY = 0.9

# Untimed steps before each timed block: PowerSGD compresses from DDP's iteration 2
# (worker.POWERSGD), so every timed step of ddp-powersgd is compressed.
REGIME_WARMUP = 3


@dataclasses.dataclass(frozen=True)
class Regime:
    name: str
    rate: str             # the emulated link, as tc spells it
    compute_over_comm_1gbit: float   # replayed compute / the expected allreduce at 1 Gbit
    band: tuple           # (low, high): the measured comm / compute that makes this regime
    what: str


REGIMES = {
    # 10 Gbit is CPU-bound on this machine (8 MB in ~26 ms, not 7), so compute is twice
    # the 1 Gbit allreduce to keep communication a small part.
    "compute-bound": Regime("compute-bound", "10gbit", 2.0, (0.0, 0.5),
                            "a fast link: communication a small part of a step"),
    "balanced": Regime("balanced", "1gbit", 1.0, (0.6, 1.6),
                       "1 Gbit, comm ≈ compute"),
    "network-bound": Regime("network-bound", "1gbit", 1 / 6, (4.0, 8.0),
                            "1 Gbit, comm ≈ 4–8 × compute"),
}


def configs_for(regime, engine):
    """The rows of `regime` (a REGIMES key) under `engine`, in table order, plus the
    `compute` and `allreduce` measurements that check the regime's ratio."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; choose from {', '.join(REGIMES)}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    rows = [BASELINE[engine], *CANDIDATES, AUTO]
    if regime == "network-bound":
        rows += peers_for(engine)
    return rows + list(MEASURES)


def peers_for(engine):
    """The peers an engine can run: Horovod's own optimizer needs Horovod's launcher."""
    return [p for p in PEERS if engine == "horovod" or not p.startswith("horovod")]


def expected_comm_s(model_bytes, workers, rate_bytes_per_s):
    """A ring allreduce's time on links of `rate_bytes_per_s` (each rank sends and receives
    2 (p - 1) / p of the gradient), at LINK_EFFICIENCY of the rate."""
    if workers < 2:
        raise ValueError(f"a regime needs at least 2 workers, got {workers}")
    return 2 * (workers - 1) / workers * model_bytes / (rate_bytes_per_s * LINK_EFFICIENCY)


def forward_flops(model, batch_size, model_mb, layers):
    """Forward FLOPs of the benchmark model at `batch_size` (replay's layer table)."""
    table = architectures.layer_table(model, batch_size, model_mb=model_mb, layers=layers)
    return sum(layer.forward_flops for layer in table), sum(layer.numel for layer in table)


def replay_tflops(flops_forward, compute_s):
    """The replayed throughput that makes forward + backward (3 × forward's FLOPs, replay's
    backward = 2 × forward) take `compute_s`."""
    if not compute_s > 0:
        raise ValueError(f"compute_s must be > 0, got {compute_s!r}")
    return 3 * flops_forward / compute_s / 1e12


def sizing(regime, flops_forward, model_bytes, workers, one_gbit_bytes_per_s):
    """{"compute_s", "device_tflops", "expected_comm_s"} of `regime` (a Regime)."""
    from pipe_horovod.tools.emulate.network import rate_bytes

    comm_1g = expected_comm_s(model_bytes, workers, one_gbit_bytes_per_s)
    compute_s = regime.compute_over_comm_1gbit * comm_1g
    return {"compute_s": compute_s, "device_tflops": replay_tflops(flops_forward, compute_s),
            "expected_comm_s": expected_comm_s(model_bytes, workers, rate_bytes(regime.rate))}


# ------------------------------------------------------------------- results

def step_s(cfg):
    """A row's step time from its raw rounds: the median of its pooled two-step means."""
    means = []
    for block in cfg["rounds"]:
        steps = block["step_s"]
        if len(steps) < 2:
            means += list(steps)
        else:
            means += [(steps[i] + steps[i + 1]) / 2 for i in range(0, len(steps) - 1, 2)]
    return statistics.median(means) if means else None


def run_result(raw):
    """What the regime table needs of one raw bench result (a worker's JSON)."""
    meta = raw["meta"]
    steps = {name: step_s(cfg) for name, cfg in raw["configs"].items()}
    compute, comm = steps.get("compute"), steps.get("allreduce")
    launch = raw.get("launch") or {}
    return {"steps": steps, "skipped": dict(meta.get("skipped") or {}),
            "run": {"steps": meta.get("steps"), "rounds": meta.get("rounds"),
                    "warmup": meta.get("warmup"), "auto_warmup": meta.get("auto_warmup"),
                    "time": meta.get("time"), "commit": launch.get("commit"),
                    "wall_s": launch.get("wall_s"), "command": launch.get("command")},
            "compute_s": compute, "comm_s": comm,
            "comm_over_compute": comm / compute if comm and compute else None,
            "auto_decision": meta.get("auto_decision"),
            "error": None}


def _ratio(a, b):
    return a / b if a and b else None


def rows_of(result, engine):
    """[(config, step_s, vs baseline, vs best fixed)] of one run (`run_result`): ratios of
    speed, baseline's (or the best candidate's) step over the row's, so above 1 is faster."""
    steps = result["steps"]
    base = steps.get(BASELINE[engine])
    best = best_fixed(result)
    out = []
    for name, step in steps.items():
        if name in MEASURES or name.startswith("allreduce"):
            continue
        out.append((name, step, _ratio(base, step), _ratio(best[1], step) if best else None))
    return out


def best_fixed(result):
    """(name, step_s) of the fastest fixed candidate measured, or None."""
    measured = [(result["steps"][n], n) for n in CANDIDATES if result["steps"].get(n)]
    if not measured:
        return None
    step, name = min(measured)
    return name, step


@dataclasses.dataclass(frozen=True)
class Target:
    regime: str
    engine: str
    what: str
    value: float          # None: not measured
    low: float            # holds when low <= value (<= high, where given)
    high: float = None
    why_not_measured: str = ""

    @property
    def holds(self):
        if self.value is None:
            return None
        return self.low <= self.value and (self.high is None or self.value <= self.high)

    def line(self):
        where = f"{self.regime}, {self.engine} engine"
        if self.value is None:
            return f"- not measured ({where}): {self.what}: {self.why_not_measured}"
        verdict = "holds" if self.holds else "does NOT hold"
        bound = (f"≥ {self.low:g}" if self.high is None
                 else f"within {self.low:g}–{self.high:g}")
        return f"- {verdict} ({where}): {self.what} = {self.value:.3f} ({bound})"


def check_targets(results):
    """[Target] for {regime: {engine: run_result}}: auto against the best fixed candidate
    and the sync baseline in every regime, against each peer where the network binds,
    and whether the measured comm / compute fell in the regime's band."""
    out = []
    for regime, by_engine in results.items():
        for engine, result in by_engine.items():
            out += _targets_of(regime, engine, result)
    return out


def _targets_of(regime, engine, result):
    low, high = REGIMES[regime].band
    if result.get("error"):
        return [Target(regime, engine, "every target", None, 0.0,
                       why_not_measured=f"the run failed: {result['error']}")]
    out = [Target(regime, engine, "measured comm / compute (the regime's ratio)",
                  result.get("comm_over_compute"), low, high,
                  why_not_measured="no compute or allreduce row")]
    steps = result["steps"]
    auto = steps.get(AUTO)
    why = result["skipped"].get(AUTO, "no ours-auto row in this run")
    best = best_fixed(result)
    base_name = BASELINE[engine]
    checks = [(f"auto vs the best fixed candidate ({best[0] if best else 'none measured'}: "
               "its step / auto's)", best[1] if best else None, AUTO_VS_BEST),
              (f"auto vs {BASELINE_LABEL[engine]} (its step / auto's)", steps.get(base_name),
               AUTO_VS_BASELINE)]
    if regime == "network-bound":
        checks += [(f"auto vs {peer} (its step / auto's)", steps.get(peer), AUTO_VS_PEER)
                   for peer in peers_for(engine)]
    for what, other, threshold in checks:
        if auto is None:
            out.append(Target(regime, engine, what, None, threshold, why_not_measured=why))
        elif other is None:
            out.append(Target(regime, engine, what, None, threshold,
                              why_not_measured="the row it is compared with was not measured"))
        else:
            out.append(Target(regime, engine, what, other / auto, threshold))
    return out


# ------------------------------------------------------------------- outputs

def _row_order(rows):
    """The rows of every engine ({engine: {name: ...}}): the sync baselines first, then
    the others in the order they ran."""
    names = [BASELINE[e] for e in ENGINES if any(BASELINE[e] in r for r in rows.values())]
    for by_name in rows.values():
        names += [n for n in by_name if n not in names]
    return names


def heading(results, workers, model):
    """What ran, when and on which commit (from the runs' own records), in one paragraph."""
    runs = [r["run"] for by in results.values() for r in by.values() if r.get("run")]
    if not runs:
        return "No run produced a result."
    first = runs[0]
    commits = sorted({r["commit"] or "unknown" for r in runs})
    times = sorted(r["time"] for r in runs if r.get("time"))
    wall = sum(r["wall_s"] or 0.0 for r in runs)
    return (f"{workers} workers on the emulated cluster, model {model['model']} "
            f"{model['model_mb']:g} MB (batch {model['batch_size']}), replayed compute; "
            f"{first['steps']} timed steps x {first['rounds']} rounds per row, interleaved, "
            f"after {first['warmup']} untimed"
            + (f" (ours-auto: {first['auto_warmup']} more before its first block)"
               if first.get("auto_warmup") is not None else "")
            + f"; commit {', '.join(commits)}; "
            + (f"{times[0]} to {times[-1]}, " if times else "")
            + f"{len(runs)} launches, {wall / 60:.1f} min of launches. Ratios are speeds: "
            "the other row's step over this row's (above 1: this row is faster).")


def _ms(x):
    return "–" if x is None else f"{x * 1e3:.1f}"


def _x(x):
    return "–" if x is None else f"{x:.2f}x"


def markdown(results, sizes=None, heading="###"):
    """One table per regime, both engines side by side, then the targets."""
    lines = []
    for regime, by_engine in results.items():
        reg = REGIMES[regime]
        lines += [f"{heading} {regime}: {reg.what}", ""]
        if sizes and regime in sizes:
            s = sizes[regime]
            lines += [f"Link {reg.rate}; compute replayed at {s['device_tflops']:.4g} TFLOP/s "
                      f"(fwd+bwd {s['compute_s'] * 1e3:.1f} ms planned, the allreduce expected "
                      f"at {s['expected_comm_s'] * 1e3:.1f} ms).", ""]
        engines = list(by_engine)
        measured = []
        for engine in engines:
            r = by_engine[engine]
            if r.get("error"):
                measured.append(f"{engine} engine: the run failed ({r['error']})")
            else:
                measured.append(f"{engine} engine: compute {_ms(r['compute_s'])} ms, allreduce "
                                f"{_ms(r['comm_s'])} ms, comm / compute "
                                f"{_x(r['comm_over_compute']).rstrip('x')}")
        lines += ["Measured: " + "; ".join(measured) + ".", ""]
        header = "| config |"
        rule = "|---|"
        for engine in engines:
            header += (f" {engine}: ms | × {BASELINE_LABEL[engine]} | × best fixed |")
            rule += "---:|---:|---:|"
        lines += [header, rule]
        rows = {e: {n: (st, vb, vf) for n, st, vb, vf in
                    (rows_of(by_engine[e], e) if not by_engine[e].get("error") else [])}
                for e in engines}
        names = _row_order(rows)
        for name in names:
            label = f"**{name}**" if name == AUTO else name
            if name == DEFAULT_ROW:
                label += " (default)"
            cells = []
            for engine in engines:
                st, vb, vf = rows[engine].get(name, (None, None, None))
                cells += [_ms(st), _x(vb), _x(vf)]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        skipped = {}
        for engine in engines:
            for name, why in by_engine[engine].get("skipped", {}).items():
                skipped.setdefault((name, why), []).append(engine)
        for (name, why), where in skipped.items():
            lines.append(f"- not measured: `{name}` ({', '.join(where)} engine): {why}")
        for engine in engines:
            decision = by_engine[engine].get("auto_decision")
            if decision:
                lines.append(f"- auto's decision ({engine} engine): {decision}")
            default = by_engine[engine].get("steps", {}).get(DEFAULT_ROW)
            auto = by_engine[engine].get("steps", {}).get(AUTO)
            if default and auto:
                lines.append(f"- auto vs today's default ({engine} engine): "
                             f"{default / auto:.3f} (default's step / auto's)")
        lines.append("")
    targets = check_targets(results)
    held = sum(1 for t in targets if t.holds)
    judged = sum(1 for t in targets if t.holds is not None)
    lines += [f"{heading} Targets: {held} of {judged} measured hold", ""]
    lines += [t.line() for t in targets]
    return "\n".join(lines) + "\n"


def plot(results, path):
    """One panel per regime: each row's speed over its engine's sync baseline, the engines'
    bars side by side, the line at 1 (the baseline) and the best fixed candidate's level."""
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()
    regimes = list(results)
    fig, axes = plt.subplots(len(regimes), 1, figsize=(12, 3.8 * len(regimes)), squeeze=False)
    colors = {"horovod": "#4c72b0", "torch": "#dd8452"}
    for ax, regime in zip(axes[:, 0], regimes):
        by_engine = results[regime]
        engines = [e for e in by_engine if not by_engine[e].get("error")]
        rows = {e: {n: vb for n, _, vb, _ in rows_of(by_engine[e], e)} for e in engines}
        names = _row_order(rows)
        width = 0.8 / max(len(engines), 1)
        for i, engine in enumerate(engines):
            xs = [k + (i - (len(engines) - 1) / 2) * width for k in range(len(names))]
            ys = [rows[engine].get(n) or 0.0 for n in names]
            bars = ax.bar(xs, ys, width, color=colors.get(engine, "#8c8c8c"),
                          label=f"{engine} engine (vs {BASELINE_LABEL[engine]})")
            for bar, n, y in zip(bars, names, ys):
                if y:
                    ax.text(bar.get_x() + bar.get_width() / 2, y, f"{y:.2f}", ha="center",
                            va="bottom", fontsize=7)
                if n == AUTO:
                    bar.set_hatch("//")
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("speed vs sync baseline")
        ratio = [by_engine[e].get("comm_over_compute") for e in engines]
        ax.set_title(f"{regime}: {REGIMES[regime].what} (measured comm / compute "
                     + ", ".join(f"{e} {r:.2f}" for e, r in zip(engines, ratio) if r)
                     + ")", fontsize=9)
        ax.legend(fontsize=7)
        top = max([v for e in engines for v in rows[e].values() if v] + [1.0])
        ax.set_ylim(0, top * 1.18)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(results, sizes=None):
    """JSON-ready: every run's rows and ratios, the sizing, and each target's outcome."""
    targets = check_targets(results)
    return {"format": "pipe_horovod.bench-regimes/1",
            "regimes": {r: {e: {**res, "rows": [
                {"config": n, "step_s": st, "vs_baseline": vb, "vs_best_fixed": vf}
                for n, st, vb, vf in (rows_of(res, e) if not res.get("error") else [])]}
                for e, res in by.items()} for r, by in results.items()},
            "sizes": sizes,
            "targets": [{**dataclasses.asdict(t), "holds": t.holds} for t in targets],
            "all_hold": all(t.holds for t in targets) if targets else False}

