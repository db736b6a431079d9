"""The report of `pipe-horovod convergence`: time to accuracy per task and configuration.

Input: one raw JSON per task (written by `pipe_horovod.tools.bench.convergence_worker`)
and, optionally, the step time of each configuration on the emulated
cluster (from `pipe-horovod bench` with the task's model). Per task and
configuration:

* final held-out accuracy, mean ± sample standard deviation over seeds;
* epochs to reach 95% and 99% of `sync`'s final mean accuracy: the first
  epoch at which the seed-mean curve is at or above it, and the median
  over seeds of each seed's first such epoch (a seed that never gets
  there counts as later than every epoch; a median among those is "not
  reached");
* wall-clock time to that accuracy = epochs x steps/epoch x step time.

Outputs: markdown (printed and saved), JSON, and a PNG with one panel per
task: mean accuracy vs epoch per configuration, ± one standard deviation
shaded.
"""
import json
import math
import os
import statistics

from pipe_horovod.tools.bench import convergence_worker as cw
from pipe_horovod.tools.bench.report import save_outputs

FRACTIONS = (0.95, 0.99)
# The convergence targets for K=2 with the best option: 99% of sync's final accuracy in at most
# 1.05 x sync's epochs, and a final accuracy at most 0.3 points below sync's.
TARGET_EPOCHS_RATIO = 1.05
TARGET_FINAL_PP = -0.3
SUMMARY_FORMAT = "pipe_horovod.convergence.summary/1"


# ------------------------------------------------------------ pure arithmetic

def epochs_to_reach(curve, threshold):
    """First epoch (1-based) whose accuracy is >= threshold, or None if none is."""
    for epoch, value in enumerate(curve, start=1):
        if value >= threshold:
            return epoch
    return None


def median_epochs(per_seed):
    """Median of per-seed epochs-to-reach; None (never) ranks after every epoch.
    Returns None when the median falls on a seed that never got there."""
    if not per_seed:
        return None
    value = statistics.median([math.inf if e is None else e for e in per_seed])
    return None if math.isinf(value) else value


def mean_std(values):
    """(mean, sample standard deviation); the deviation is 0.0 for a single value."""
    values = list(values)
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def mean_curve(curves):
    """Per-epoch (means, sample standard deviations) over equally long curves."""
    columns = list(zip(*curves))
    stats = [mean_std(c) for c in columns]
    return [m for m, _ in stats], [s for _, s in stats]


# ------------------------------------------------------------------ step times

def _bench_step_times(data):
    """{bench config: step seconds} from a `pipe-horovod bench` raw or summary JSON."""
    if data.get("format") == "pipe_horovod.bench/1":
        from pipe_horovod.tools.bench import report

        data = report.summarize(data)
    return {name: s["step_s"] for name, s in data["configs"].items() if s.get("step_s")}


def step_times_from_bench(data, configs):
    """{config: step seconds} for our configurations, from a bench raw or summary JSON:
    sync <- ours-k1, kK <- ours-kK-none, kK-OPTION <- ours-kK-OPTION."""
    bench = _bench_step_times(data)
    return {c: bench[cw.bench_config(c)] for c in configs if cw.bench_config(c) in bench}


def load_step_times(specs, tasks, configs):
    """{task: {config: {"step_s", "source"}}} from --step-times values.

    Each spec is `FILE.json` or `TASK=FILE.json`. FILE is a `pipe-horovod bench`
    output (raw `<name>-raw.json` or summary `<name>.json`, run with the task's
    `--model`; needs TASK=), a {config: seconds} map (TASK=, or every task), or
    a {task: {config: seconds}} map.
    """
    out = {t: {} for t in tasks}
    for spec in specs or []:
        task, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if task and task not in tasks:
            raise ValueError(f"--step-times {spec}: task {task!r} is not among the tasks "
                             f"reported ({', '.join(tasks)})")
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"--step-times {spec}: expected a JSON object")
        is_bench = data.get("format") == "pipe_horovod.bench/1" or (
            isinstance(data.get("configs"), dict) and "meta" in data)
        if is_bench:
            if not task:
                raise ValueError(f"--step-times {spec}: a bench result times one model; "
                                 "say which task it is for: TASK=FILE")
            found = step_times_from_bench(data, configs)
            if not found:
                raise ValueError(f"--step-times {spec}: none of "
                                 f"{', '.join(cw.bench_config(c) for c in configs)} was measured")
            for c, s in found.items():
                out[task][c] = {"step_s": s, "source": f"{path} ({cw.bench_config(c)})"}
            continue
        nested = all(isinstance(v, dict) for v in data.values())
        per_task = data if nested else {t: data for t in ([task] if task else tasks)}
        for t, table in per_task.items():
            if t not in out:
                continue
            for c, s in table.items():
                if not isinstance(s, (int, float)) or not s > 0:
                    raise ValueError(f"--step-times {spec}: {t}/{c}: expected seconds > 0, "
                                     f"got {s!r}")
                out[t][c] = {"step_s": float(s), "source": path}
    return out


# ------------------------------------------------------------------- summary

def summarize_task(raw, step_times=None):
    """Per-configuration figures of one task's raw result (see the module doc)."""
    step_times = step_times or {}
    epochs = raw["epochs"]
    spe = raw["steps_per_epoch"]
    by_config = {}
    for run in raw["runs"]:
        by_config.setdefault(run["config"], []).append(run)
    sync_final = None
    if "sync" in by_config:
        sync_final = mean_std(r["accuracy"][-1] for r in by_config["sync"])[0]
    thresholds = {f"{round(100 * f)}": f * sync_final for f in FRACTIONS} if sync_final else {}

    configs = {}
    for config in [c for c in raw["configs"] if c in by_config]:
        runs = sorted(by_config[config], key=lambda r: r["seed"])
        curves = [r["accuracy"] for r in runs]
        mean, std = mean_curve(curves)
        final_mean, final_std = mean_std(c[-1] for c in curves)
        step = step_times.get(config)
        row = {"config": config, "seeds": [r["seed"] for r in runs],
               "pipeline_depth": runs[0]["pipeline_depth"],
               "staleness_compensation": runs[0]["staleness_compensation"],
               "final_mean": final_mean, "final_std": final_std,
               "final_per_seed": [c[-1] for c in curves],
               "final_vs_sync_pp": (100 * (final_mean - sync_final)
                                    if sync_final is not None else None),
               "mean_curve": mean, "std_curve": std,
               "train_time_s_mean": statistics.fmean(r["train_time_s"] for r in runs),
               "ranks_agree": all(r["ranks_agree"] for r in runs),
               "step_s": step["step_s"] if step else None,
               "step_source": step["source"] if step else None,
               "to": {}}
        for key, threshold in thresholds.items():
            per_seed = [epochs_to_reach(c, threshold) for c in curves]
            on_mean = epochs_to_reach(mean, threshold)
            row["to"][key] = {
                "threshold": threshold, "epochs": on_mean,
                "epochs_per_seed": per_seed, "epochs_seed_median": median_epochs(per_seed),
                "time_s": (on_mean * spe * step["step_s"]
                           if step and on_mean is not None else None)}
        configs[config] = row
    sync = configs.get("sync")
    for row in configs.values():
        for key, to in row["to"].items():
            base = sync["to"][key] if sync else None
            to["epochs_vs_sync"] = (to["epochs"] / base["epochs"]
                                    if base and base["epochs"] and to["epochs"] else None)
            to["speedup_vs_sync"] = (base["time_s"] / to["time_s"]
                                     if base and base["time_s"] and to["time_s"] else None)
        ratio = row["to"].get("99", {}).get("epochs_vs_sync")
        row["meets_targets"] = (None if sync is None or row is sync else
                                ratio is not None and ratio <= TARGET_EPOCHS_RATIO
                                and row["final_vs_sync_pp"] >= TARGET_FINAL_PP)
    return {"task": raw["task"], "engine": raw["engine"], "workers": raw["workers"],
            "epochs": epochs, "steps_per_epoch": spe, "seeds": raw["seeds"],
            "n_train": raw["n_train"], "n_test": raw["n_test"],
            "sync_final_mean": sync_final, "thresholds": thresholds, "configs": configs}


def summarize(raws, step_times=None, command=None):
    step_times = step_times or {}
    return {"format": SUMMARY_FORMAT, "command": command,
            "tasks": [summarize_task(raw, step_times.get(raw["task"]["name"]))
                      for raw in raws]}


# ------------------------------------------------------------------ markdown

def _pct(x, digits=2):
    return "–" if x is None else f"{100 * x:.{digits}f}"


def _epochs(to):
    if to is None:
        return "–"
    mean = "never" if to["epochs"] is None else str(to["epochs"])
    med = to["epochs_seed_median"]
    med = "never" if med is None else f"{med:g}"
    return f"{mean} ({med})"


def _time(to):
    if to is None or to["time_s"] is None:
        return "–"
    speed = f" ({to['speedup_vs_sync']:.2f}x)" if to.get("speedup_vs_sync") else ""
    return f"{to['time_s']:.2f}{speed}"


def markdown(summary, heading="##"):
    lines = []
    for t in summary["tasks"]:
        task = t["task"]
        lines += [f"{heading} {task['name']}: {task['summary']}", "",
                  f"{t['workers']} workers (engine {t['engine']}), {t['epochs']} epochs of "
                  f"{t['steps_per_epoch']} steps, batch {task['batch_size_per_worker']}/worker, "
                  f"lr {task['lr']:g} ({task['schedule']}), momentum {task['momentum']:g}; "
                  f"seeds {t['seeds'][0]}..{t['seeds'][-1]}; held-out set {t['n_test']} images."]
        if t["sync_final_mean"] is not None:
            lines.append(f"Targets: 95% / 99% of sync's final mean accuracy "
                         f"({_pct(t['sync_final_mean'])}%) = "
                         + " / ".join(f"{_pct(v)}%" for v in t["thresholds"].values()) + ".")
        lines += ["",
                  "| config | final acc. % (mean ± std) | vs sync (pp) | epochs to 95% "
                  "(seed median) | epochs to 99% (seed median) | epochs to 99% / sync's | "
                  "step ms | time to 95% s (speed-up) | time to 99% s (speed-up) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c in t["configs"].values():
            vs = "–" if c["final_vs_sync_pp"] is None else f"{c['final_vs_sync_pp']:+.2f}"
            to95, to99 = c["to"].get("95"), c["to"].get("99")
            ratio = (f"{to99['epochs_vs_sync']:.2f}"
                     if to99 and to99.get("epochs_vs_sync") else "–")
            step = "–" if c["step_s"] is None else f"{1e3 * c['step_s']:.2f}"
            flag = "" if c["ranks_agree"] else " (ranks disagree!)"
            lines.append(f"| {c['config']}{flag} | {_pct(c['final_mean'])} ± "
                         f"{_pct(c['final_std'])} | {vs} | {_epochs(to95)} | {_epochs(to99)} | "
                         f"{ratio} | {step} | {_time(to95)} | {_time(to99)} |")
        if t["sync_final_mean"] is not None:
            met = [c["config"] for c in t["configs"].values() if c["meets_targets"]]
            lines += ["", f"The convergence targets (99% of sync's final accuracy in <= "
                          f"{TARGET_EPOCHS_RATIO:g} x sync's epochs, final accuracy at most "
                          f"{-TARGET_FINAL_PP:g} pp below sync's): "
                          + (f"met by {', '.join(met)}." if met else "met by none.")]
        lines.append("")
    lines += ["Epochs to X%: first epoch whose seed-mean held-out accuracy reaches X% of "
              "sync's final mean; in brackets the median over seeds of each seed's first "
              "such epoch ('never': not within the run). Time = epochs x steps/epoch x step "
              "time; speed-up = sync's time / this one's. Step time: '–' without "
              "--step-times / --emulate.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot

def plot(summary, path):
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    tasks = summary["tasks"]
    ncols = min(3, len(tasks))
    nrows = math.ceil(len(tasks) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, t in zip(axes.flat, tasks):
        for i, c in enumerate(t["configs"].values()):
            x = list(range(1, len(c["mean_curve"]) + 1))
            mean = [100 * v for v in c["mean_curve"]]
            std = [100 * v for v in c["std_curve"]]
            color = f"C{i}"
            style = "-" if c["config"] in ("sync", "k2") else "--"
            ax.plot(x, mean, style, color=color, lw=2 if c["config"] == "sync" else 1.3,
                    label=c["config"])
            ax.fill_between(x, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)], color=color, alpha=0.12, lw=0)
        for key, value in t["thresholds"].items():
            ax.axhline(100 * value, color="grey", lw=0.7, ls=":")
            ax.text(1, 100 * value, f" {key}% of sync", fontsize=7, color="grey", va="bottom")
        lowest = [100 * v for c in t["configs"].values() for v in c["mean_curve"]]
        ax.set_ylim(max(0.0, 10 * math.floor(min(lowest, default=0.0) / 10 - 0.5)), 100)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel("held-out accuracy % (mean ± std over seeds)")
        ax.set_title(f"{t['task']['name']} ({len(t['seeds'])} seeds, {t['workers']} workers)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------- writing

def write_report(raws, out_dir, name="convergence", step_times=None, command=None):
    """Writes <name>.md, <name>.json, <name>.png under out_dir; returns (markdown, paths)."""
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(raws, step_times, command)
    text = markdown(summary, "##")
    if command:
        text = f"Command: `{command}`\n\n" + text
    paths = save_outputs(out_dir, name, text, summary)
    plot(summary, paths["png"])
    return text, paths
