"""Speed-up over Horovod's DistributedOptimizer of each training row of several
`pipe-horovod bench` runs (their summary JSON, `docs/bench/NAME.json`), measured and as
the report predicted, beside a target line: one PNG for docs/results.md (issue 40 item 4).

    python scripts/speedup_plot.py --target 5.4 --out docs/results-issue40.png \
        docs/bench/issue40-r50-p2-int4kernels.json docs/bench/issue40-r50-p4-int4kernels.json \
        docs/bench/issue40-bert-p2.json docs/bench/issue40-bert-p4.json
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def speedups(summary):
    """{row: (measured, predicted or None)} over the run's `horovod` row, training rows of
    ours only."""
    configs = summary["configs"]
    base = configs["horovod"]["step_s"]
    return {name: (base / s["step_s"], base / s["predicted_s"] if s.get("predicted_s") else None)
            for name, s in configs.items() if name.startswith("ours-k") and s.get("step_s")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summaries", nargs="+", type=Path)
    p.add_argument("--target", type=float, default=5.4)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runs = []
    for path in args.summaries:
        summary = json.loads(path.read_text())
        meta = summary["meta"]
        runs.append((f"{meta['model']}\n{meta['workers']} workers", speedups(summary)))
    rows = sorted({name for _, got in runs for name in got})
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(rows):
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(runs))]
        measured = [got.get(name, (0, None))[0] for _, got in runs]
        bars = ax.bar(xs, measured, width, label=name)
        predicted = [got.get(name, (0, None))[1] for _, got in runs]
        ax.scatter([x for x, v in zip(xs, predicted) if v], [v for v in predicted if v],
                   marker="_", s=300, color=bars.patches[0].get_facecolor(), zorder=3)
        for x, v in zip(xs, measured):
            if v:
                ax.text(x, v + 0.05, f"{v:.2f}x", ha="center", fontsize=7)
    ax.axhline(args.target, color="black", linestyle="--", linewidth=1)
    ax.text(len(runs) - 0.5, args.target + 0.08, f"target {args.target}x", ha="right", fontsize=8)
    ax.set_xticks(range(len(runs)), [label for label, _ in runs])
    ax.set_ylabel("speed-up over Horovod (step time ratio)")
    ax.set_title("Replayed compute, emulated 1 Gbit: bars measured, dashes the report's "
                 "prediction", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
