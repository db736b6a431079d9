"""Issue 36 item 5's probe: where the default's prediction goes wrong at d=128 with Keras's
initialization, and what other estimates of the in-flight averaged gradient do there.

An experiment, not a feature: the PyTorch adapter's default (K=2, lookahead) on
convergence_lm's task (its data, model, schedule and loop; `--init keras`), with
pipe_horovod.torch.lookahead.predict wrapped so that (1) every prediction's error is
logged per group of tensors (q, k, v rows of the attention kernels, ...) against the
true averaged gradient of the step in flight (found by one extra blocking allreduce per
step, which changes no number of the run), for several estimates of that average at
once; (2) the estimate the prediction uses is chosen by --estimate (default "own", the
shipped rule: the run is then the default's, bit for bit).

The errors are in Adam's normalized space: (1 - beta1) * step_size * (est - avg) / denom,
the part of the predicted update the estimate decides, beside the norm of the real
update from the same state. Run (2 ranks):

    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/issue36_probe.py \
        --estimate own --seed 1 --out docs/convergence/issue36/probe-own-s1.json
"""
import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn.functional as F

import pipe_horovod.torch as phvd
from pipe_horovod.compression import two_stage
from pipe_horovod.torch import lookahead
from pipe_horovod.tools.bench import convergence_lm as lm

ESTIMATES = ("own", "oracle", "oracle-qk", "oracle-noqk", "landed", "mean", "half-mean",
             "half-landed", "half-own", "zero", "rho", "rho-ema", "spread-half",
             "oracle-q", "pre-int4", "pre-int4-own")
# Estimates of Adam's second-moment term only: the prediction's numerator uses this rank's
# own gradient (as the default), the denominator b2 v + (1 - b2) X with X = the true
# average squared ("v-oracle"), the last landed average squared ("v-landed"), or v itself
# ("v-none"); written out here (AdamW's single-tensor rule) in place of lookahead's.
V_ESTIMATES = ("v-oracle", "v-landed", "v-none")
RHO_DECAY = 0.9          # "rho-ema": the decay of the running squared norms


def groups_of(name, d):
    """[(group, slice of rows or None)] for a parameter's name in lm.torch_model."""
    if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
        suffix = "" if name.endswith("weight") else "_b"
        return [("q" + suffix, slice(0, d)), ("k" + suffix, slice(d, 2 * d)),
                ("v" + suffix, slice(2 * d, 3 * d))]
    for key in ("proj", "fc1", "fc2", "head"):
        if f"{key}." in name:
            return [(key, None)]
    if name in ("tok.weight", "pos"):
        return [("emb", None)]
    return [("ln", None)]


class Probe:
    def __init__(self, model, estimate, d):
        self.name_of = {p: n for n, p in model.named_parameters()}
        self.estimate, self.d = estimate, d
        self.avg, self.landed, self.prev_avg, self.qavg, self.qown = {}, {}, {}, {}, {}
        self.log = []
        self.step = 0
        # "rho": per tensor, |avg|^2 / |own|^2 of the previous step (its averaged gradient
        # has landed by now); "rho-ema": the same from running means of both.
        self.prev, self.ema = {}, {}

    def wrap(self, predict):
        def wrapped(cls, groups, state, locals_):
            if self.avg and all("step" in state.get(q, {}) for q in locals_):
                self.observe(groups, state, locals_)
                if self.estimate in V_ESTIMATES:
                    return self.adamw(groups, state, locals_)
            return predict(cls, groups, state, locals_)
        return wrapped

    def estimates(self, p, own, m_hat):
        """Each estimate of the step's averaged gradient, for parameter p: "own" (the
        default's), "oracle" (the true average), "oracle-qk" / "oracle-q" / "oracle-noqk"
        (the true average on the q and k rows of an attention kernel / the q rows / all
        but q and k), "landed" (the average applied at this step, clipped), "mean" (Adam's
        bias-corrected first moment m_hat), the halves of own with those, "half-own",
        "zero", "rho" / "rho-ema" (own x min(1, |avg|^2/|own|^2) measured on the previous
        step / running means: what a rank can measure for free), "spread-half" (the
        ranks' points half as far from the true one, about it), "pre-int4" (the average
        of the ranks' gradients quantized as int4_ef's wire, what a blocking int4 exchange
        before the next forward would give every rank: direction (c)) and "pre-int4-own"
        (the same with this rank's own part exact: own - int4(own) + that average, centred
        on the true average over the ranks)."""
        avg, landed = self.avg[p], self.landed.get(p, torch.zeros_like(own))
        qk = self.name_of[p].endswith(("qkv.weight", "qkv.bias"))
        own2, avg2 = self.prev.get(p, (1.0, 1.0))
        e_own2, e_avg2 = self.ema.get(p, (1.0, 1.0))
        rho = min(1.0, avg2 / own2) if own2 > 0 else 1.0
        rho_ema = min(1.0, e_avg2 / e_own2) if e_own2 > 0 else 1.0
        return {"own": own, "oracle": avg, "landed": landed, "mean": m_hat,
                "half-mean": (own + m_hat) / 2, "half-landed": (own + landed) / 2,
                "half-own": own / 2, "zero": torch.zeros_like(own),
                "rho": own * rho, "rho-ema": own * rho_ema,
                "oracle-qk": self._rows(own, avg, qk), "oracle-noqk": self._rows(avg, own, qk),
                "oracle-q": self._rows(own, avg, qk, rows=self.d),
                "spread-half": avg + (own - avg) / 2, "pre-int4": self.qavg.get(p, own),
                "pre-int4-own": own - self.qown.get(p, own) + self.qavg.get(p, own)}

    def _rows(self, base, qk_value, qk, rows=None):
        """base with the q and k rows (or the first `rows`) of an attention kernel taken
        from qk_value."""
        if not qk:
            return base
        rows = 2 * self.d if rows is None else rows
        out = base.clone()
        out[:rows] = qk_value[:rows]
        return out

    @torch.no_grad()
    def adamw(self, groups, state, locals_):
        """AdamW's update of the real weights p with the numerator from this rank's own
        gradient and the second moment's new term from the --estimate."""
        out = {}
        for group in groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p not in locals_:
                    continue
                st, g = state[p], locals_[p]
                step = float(st["step"]) + 1
                x = {"v-oracle": lambda: self.avg[p] ** 2,
                     "v-landed": lambda: self.prev_avg.get(p, self.avg[p]) ** 2,
                     "v-none": lambda: st["exp_avg_sq"]}[self.estimate]()
                v = beta2 * st["exp_avg_sq"] + (1 - beta2) * x
                m = torch.lerp(st["exp_avg"], g, 1 - beta1)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)) + eps
                g.copy_(p.detach() * (1 - lr * wd) - lr / (1 - beta1 ** step) * m / denom)
                out[p] = g
        return out

    @torch.no_grad()
    def observe(self, groups, state, locals_):
        sums = {}
        for group in groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p not in locals_:
                    continue
                st = state[p]
                step = float(st["step"]) + 1
                own = locals_[p].clone()
                avg = self.avg[p]
                denom = ((beta2 * st["exp_avg_sq"] + (1 - beta2) * avg * avg)
                         / (1 - beta2 ** step)).sqrt() + group["eps"]
                step_size = group["lr"] / (1 - beta1 ** step)
                m_hat = st["exp_avg"] / (1 - beta1 ** (step - 1)) if step > 1 else own
                update = step_size * (beta1 * st["exp_avg"] + (1 - beta1) * avg) / denom
                ests = self.estimates(p, own, m_hat)
                for g, rows in groups_of(self.name_of[p], self.d):
                    r = (lambda t: t[rows]) if rows is not None else (lambda t: t)
                    acc = sums.setdefault(g, {"update2": 0.0, "dot": 0.0, "own2": 0.0,
                                              "avg2": 0.0})
                    acc["update2"] += float(r(update).pow(2).sum())
                    acc["w2"] = acc.get("w2", 0.0) + float(r(p.detach()).pow(2).sum())
                    acc["dot"] += float((r(own) * r(avg)).sum())
                    acc["own2"] += float(r(own).pow(2).sum())
                    acc["avg2"] += float(r(avg).pow(2).sum())
                    for k, e in ests.items():
                        err = step_size * (1 - beta1) * r(e - avg) / r(denom)
                        acc["err2_" + k] = acc.get("err2_" + k, 0.0) + float(err.pow(2).sum())
                if self.estimate != "own" and self.estimate in ests:
                    locals_[p].copy_(ests[self.estimate])
                own2, avg2 = float(own.pow(2).sum()), float(avg.pow(2).sum())
                self.prev[p] = (own2, avg2)
                e = self.ema.get(p)
                self.ema[p] = (own2, avg2) if e is None else (
                    RHO_DECAY * e[0] + (1 - RHO_DECAY) * own2,
                    RHO_DECAY * e[1] + (1 - RHO_DECAY) * avg2)
        self.log.append({"step": self.step, "groups": sums})

    def after_backward(self, model):
        """The true average of this step's local gradients (the probe's extra allreduce)."""
        params = [p for p in model.parameters()]
        self.prev_avg = self.avg
        local = torch.cat([p.grad.reshape(-1) for p in params])
        flat = phvd.allreduce(local, op=phvd.Average, name="probe.avg")
        _, quantized = two_stage.quantize(local, two_stage.WireFormat("int4"))
        qflat = phvd.allreduce(quantized, op=phvd.Average, name="probe.qavg")
        self.avg, self.qavg, self.qown, start = {}, {}, {}, 0
        for p in params:
            self.qown[p] = quantized[start:start + p.numel()].view_as(p).clone()
            self.avg[p] = flat[start:start + p.numel()].view_as(p).clone()
            self.qavg[p] = qflat[start:start + p.numel()].view_as(p).clone()
            start += p.numel()

    def after_clip(self, model):
        self.landed = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}


WINDOW = 25             # steps per row of the stored log


def compact(log, width=WINDOW):
    """The per-step log summed over windows of `width` steps, to 4 significant digits
    (what the figure and docs/convergence.md read; the per-step log is megabytes)."""
    rows = []
    for start in range(0, len(log), width):
        part = log[start:start + width]
        sums = {}
        for entry in part:
            for g, acc in entry["groups"].items():
                into = sums.setdefault(g, {})
                for k, v in acc.items():
                    into[k] = into.get(k, 0.0) + v
        rows.append({"first_step": part[0]["step"], "steps": len(part),
                     "groups": {g: {k: float(f"{v:.4g}") for k, v in acc.items()}
                                for g, acc in sums.items()}})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--estimate", choices=ESTIMATES + V_ESTIMATES, default="own")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--init", default="keras")
    ap.add_argument("--config", default="k2-lookahead")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    phvd.init()
    rank, size = phvd.rank(), phvd.size()
    s = lm.Settings(steps=args.steps, d_model=args.d_model, init=args.init)
    train, vx, vy = lm.data(s)
    from pipe_horovod.tools.bench.convergence_worker import config_settings
    depth, option = config_settings(args.config)
    torch.manual_seed(args.seed)
    model = lm.torch_model(s)
    probe = Probe(model, args.estimate, s.d_model)
    lookahead.predict = probe.wrap(lookahead.predict)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr * size, betas=(s.beta1, s.beta2),
                            weight_decay=s.weight_decay)
    opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    pipeline_depth=depth, staleness_compensation=option)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lm.lr_at(s, size, t) / (s.lr * size))
    phvd.broadcast_parameters(model.state_dict(), root_rank=0)
    phvd.broadcast_optimizer_state(opt, root_rank=0)
    xs = torch.from_numpy(lm.batches(train, s, args.seed, rank)).long()
    vx, vy = torch.from_numpy(vx).long(), torch.from_numpy(vy).long()
    hist = {"steps": [], "val_loss": []}
    start = time.perf_counter()
    for step in range(s.steps):
        probe.step = step
        x, y = xs[step, :, :-1], xs[step, :, 1:]
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        loss.backward()
        probe.after_backward(model)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        probe.after_clip(model)
        with opt.skip_synchronize():
            opt.step()
        sched.step()
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            opt.flush()
            with torch.no_grad():
                v = F.cross_entropy(model(vx).reshape(-1, lm.VOCAB), vy.reshape(-1)).item()
            hist["steps"].append(step + 1)
            hist["val_loss"].append(v)
            if rank == 0:
                print(f"[probe] {args.estimate} seed {args.seed} step {step + 1} val {v:.4f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "settings": dataclasses.asdict(s),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **hist,
                       "log": compact(probe.log)}, f)
    phvd.shutdown()




def report(out_png, sync_raw, probes):
    """The figure of docs/convergence.md's probe: validation loss of sync (from a
    convergence_lm raw file, seed 1) and of each probe run; and the prediction's error per
    group of tensors, relative to the update, along the default's run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(sync_raw) as f:
        sync = next(r for r in json.load(f)["runs"] if r["config"] == "sync" and r["seed"] == 1)
    runs = {}
    for path in probes:
        with open(path) as f:
            runs[path] = json.load(f)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    a.plot(sync["steps"], sync["val_loss"], "k-", marker=".", label="sync (K=1)")
    for r in runs.values():
        a.plot(r["steps"], r["val_loss"], marker=".", label=f"K=2, estimate {r['args']['estimate']}")
    a.set_xlabel("step")
    a.set_ylabel("validation loss (seed 1)")
    a.set_title("d=128, Keras's init, PyTorch adapter")
    a.grid(alpha=0.3)
    a.legend(fontsize=7)
    own = next((r for r in runs.values() if r["args"]["estimate"] == "own"), None)
    if own is not None:
        for g in ("q", "k", "v", "proj", "fc1", "head"):
            xs = [row["first_step"] + row["steps"] / 2 for row in own["log"]]
            ys = [math.sqrt(row["groups"][g]["err2_own"] / row["groups"][g]["update2"])
                  for row in own["log"]]
            b.plot(xs, ys, marker=".", label=g)
        b.set_xlabel("step")
        b.set_ylabel("|predicted - true update| / |update|")
        b.set_title("the default's prediction error per group (seed 1)")
        b.set_ylim(0, 0.6)
        b.grid(alpha=0.3)
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys
    if sys.argv[1:2] == ["--report"]:      # --report OUT.png SYNC_RAW.json PROBE.json...
        report(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1:2] == ["--compact"]:   # --compact PROBE.json...: a per-step log to windows
        for path in sys.argv[2:]:
            with open(path) as f:
                raw = json.load(f)
            if raw["log"] and "step" in raw["log"][0]:
                raw["log"] = compact(raw["log"])
                with open(path, "w") as f:
                    json.dump(raw, f)
    else:
        main()
