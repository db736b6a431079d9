"""A sweep of the Keras transformer task over what Keras's optimizer does around its rule
(learning-rate schedules, clipping, weight decay, run length and backend), to find which of
them decides the default's lag behind sync.

Each cell is one `convergence_lm` launch (2 ranks, sync and the default, N seeds) with the
cell's settings; the report puts every cell's final validation losses side by side with
the default's gap to sync (target: within convergence_TARGET in every cell) and plots
the gaps per cell and seed.

Designs (`--sweep NAME`):

* issue36: a fractional factorial of 12 cells: every schedule x clipping pair (4 x 3:
  CosineDecay with warm-up, ExponentialDecay, PiecewiseConstantDecay, a constant;
  global_clipnorm, clipnorm, none), weight decay and backend assigned so that each
  schedule and each clipping meets both values of each and the four (decay, backend)
  pairs all occur, and the run length (400, 800 or 1600 steps: STEPS_BY_CELL) varied
  across schedules and clippings;
* or cells written out: `framework:schedule:clipping:weight_decay:steps,...`.
"""
import json
import os
import shlex
import statistics
import sys
from dataclasses import dataclass

from .lm_settings import CLIPPINGS, FRAMEWORKS, SCHEDULES, TARGET, Settings

# Run lengths, cell by cell of issue36(): 800 steps on the held-out task's own cell
# (CosineDecay warm-up, global_clipnorm, AdamW, TensorFlow) and two more, one of them on
# torch; 1600 once, on TensorFlow; 400 elsewhere.
STEPS_BY_CELL = (800, 400, 400, 400, 800, 400, 400, 800, 400, 400, 1600, 400)


@dataclass(frozen=True)
class Cell:
    framework: str
    schedule: str
    clipping: str
    weight_decay: float
    steps: int

    @property
    def key(self):
        return (f"{self.framework}-{self.schedule}-{self.clipping}-wd{self.weight_decay:g}-"
                f"{self.steps}")

    @classmethod
    def parse(cls, text):
        try:
            framework, schedule, clipping, weight_decay, steps = text.split(":")
            cell = cls(framework, schedule, clipping, float(weight_decay), int(steps))
        except ValueError:
            raise SystemExit(f"a cell is framework:schedule:clipping:weight_decay:steps, "
                             f"got {text!r}") from None
        if framework not in FRAMEWORKS[1:] or schedule not in SCHEDULES or \
                clipping not in CLIPPINGS or cell.steps <= 0:
            raise SystemExit(f"cell {text!r}: a Keras framework ({', '.join(FRAMEWORKS[1:])}"
                             f"), a schedule ({', '.join(SCHEDULES)}), a clipping "
                             f"({', '.join(CLIPPINGS)}) and steps > 0")
        return cell


def issue36():
    """The fractional design (the module's docstring says how it is balanced)."""
    schedules = ("cosine", "exponential", "piecewise", "constant")
    clippings = ("global", "norm", "none")
    cells = []
    for s, schedule in enumerate(schedules):
        for c, clipping in enumerate(clippings):
            decay = 0.1 if (s + c) % 2 == 0 else 0.0
            framework = ("keras-tf", "keras-torch")[(s // 2 + c) % 2]
            cells.append(Cell(framework, schedule, clipping, decay,
                              STEPS_BY_CELL[len(cells)]))
    return cells


DESIGNS = {"issue36": issue36}


def cells_of(text):
    return DESIGNS[text]() if text in DESIGNS else [Cell.parse(t) for t in text.split(",")]


def run(args, argv, launch):
    """Launch every cell not already on disk (or, --report-only, none), then report.

    `launch(args, framework, settings, out_dir)` runs one cell: convergence_lm.launch, which
    calls this (so this module does not import it)."""
    cells = cells_of(args.sweep)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    command = shlex.join(["pipe-horovod", "convergence-lm", *(
        argv if argv is not None else sys.argv[1:])])
    results = []
    for i, cell in enumerate(cells):
        name = f"{args.name}-{cell.key}"
        path = os.path.join(out_dir, f"{name}-{cell.framework}-raw.json")
        if not os.path.exists(path):
            if args.report_only:
                continue
            print(f"[sweep] cell {i + 1}/{len(cells)}: {cell.key}", file=sys.stderr, flush=True)
            cell_args = _with(args, name=name, configs="sync,k2-lookahead")
            s = Settings(steps=cell.steps, schedule=cell.schedule, clipping=cell.clipping,
                            weight_decay=cell.weight_decay, d_model=args.d_model,
                            init=args.init, exchange=args.exchange)
            launch(cell_args, cell.framework, s, out_dir)
        with open(path) as f:
            results.append((cell, json.load(f)))
    rows = [row(cell, raw) for cell, raw in results]
    text = markdown(rows, command)
    with open(os.path.join(out_dir, f"{args.name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, f"{args.name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if rows:
        plot(rows, os.path.join(out_dir, f"{args.name}.png"))
    print(text)
    return 0


def _with(args, **changes):
    copy = type(args)(**vars(args))
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy


def row(cell, raw):
    """A cell's figures: per seed, sync's and the default's final validation loss and the
    default's gap; their means."""
    finals = {config: {r["seed"]: r["val_loss"][-1] for r in raw["runs"] if r["config"] == config}
              for config in ("sync", "k2-lookahead")}
    seeds = sorted(set(finals["sync"]) & set(finals["k2-lookahead"]))
    gaps = [finals["k2-lookahead"][s] - finals["sync"][s] for s in seeds]
    return {"cell": cell.key, "framework": cell.framework, "schedule": cell.schedule,
            "clipping": cell.clipping, "weight_decay": cell.weight_decay, "steps": cell.steps,
            "d_model": raw["settings"]["d_model"], "seeds": seeds,
            "sync": [finals["sync"][s] for s in seeds],
            "default": [finals["k2-lookahead"][s] for s in seeds], "gaps": gaps,
            "gap": statistics.fmean(gaps) if gaps else None,
            "ranks_agree": all(r["ranks_agree"] for r in raw["runs"]),
            "s_per_run": statistics.fmean(r["train_time_s"] for r in raw["runs"])}


def markdown(rows, command):
    lines = [f"Command: `{command}`", "",
             "| backend | schedule | clipping | weight decay | steps | sync (K=1) | default "
             "(K=2, lookahead) | gap per seed | gap (mean) | within "
             f"{TARGET} | s/run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mean = statistics.fmean
        lines.append(
            f"| {r['framework']} | {r['schedule']} | {r['clipping']} | {r['weight_decay']:g} | "
            f"{r['steps']} | {mean(r['sync']):.4f} | {mean(r['default']):.4f} | "
            f"{' / '.join(f'{g:+.4f}' for g in r['gaps'])} | **{r['gap']:+.4f}** | "
            f"{'yes' if r['gap'] <= TARGET else 'no'} | {r['s_per_run']:.0f} |")
    if rows:
        worst = max(rows, key=lambda r: r["gap"])
        lines += ["", f"{len(rows)} cells x {len(rows[0]['seeds'])} seeds; the worst gap: "
                      f"{worst['gap']:+.4f} ({worst['cell']}); every run's ranks agree: "
                      f"{all(r['ranks_agree'] for r in rows)}."]
    return "\n".join(lines)


def plot(rows, path):
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(rows) + 2), 4.5))
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["gaps"]), r["gaps"], color="tab:gray", s=12, zorder=2)
        ax.bar(i, r["gap"], color="tab:blue" if r["framework"] == "keras-tf" else "tab:orange",
               alpha=0.7, zorder=1)
    ax.axhline(TARGET, color="tab:red", linestyle="--", linewidth=1,
               label=f"target (+{TARGET})")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['schedule']}\n{r['clipping']}, wd {r['weight_decay']:g}\n"
                        f"{r['steps']} {r['framework'][6:]}" for r in rows], fontsize=7)
    ax.set_ylabel("default - sync, final validation loss")
    ax.set_title("Keras: the default's gap to sync per cell (bars: mean; dots: seeds; "
                 "blue TensorFlow, orange torch)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
