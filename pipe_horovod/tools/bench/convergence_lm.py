"""The transformer task of the convergence study: a character-level language model
trained with AdamW, in PyTorch and in Keras 3 (TensorFlow and torch backends).

Why this task: the digits tasks of `pipe-horovod convergence` train CNNs with
SGD, where a one-step delay costs little. Users who reach for a pipelined
optimizer train transformers with AdamW, warm-up + cosine and gradient
clipping, where a plain K=2 delay hurts (1.82 vs 1.49 validation loss at
first measured) and the default staleness compensation ("lookahead") has to make up
for it. This study shows, in each adapter, sync (pipeline_depth=1) vs the
default (K=2, lookahead) vs plain K=2 (staleness_compensation=None); on
request also the default with compression=int8_ef or int4_ef on the engine's
own collectives (`k2-lookahead-int8_ef`, `k2-lookahead-int4_ef`), under torch.distributed.run or (`--engine horovod`, PyTorch only)
horovodrun.

Everything is CPU-sized (a 2-core machine runs the whole PyTorch study in
minutes) and ships with Python: the text is the standard library's own
top-level sources (`<stdlib>/*.py`, sorted by name, concatenated), so
nothing is downloaded. Characters outside printable ASCII become '?'; the
vocabulary is the 96 codes '\\n' + chr(32..126) + '?' stand-ins. The first
`--train-chars` characters train, the next `--val-chars` validate (fixed,
evenly spaced windows, the same for every run).

The model (the same in both frameworks): token + learned position
embeddings, `--layers` pre-norm blocks (causal multi-head attention, a
4x GELU MLP), a final LayerNorm and a linear head; no dropout, so runs are
deterministic given the seed.

Training, as a user writes it with Horovod:

* PyTorch: `torch.optim.AdamW(lr=3e-3 x size, betas=(0.9, 0.95),
  weight_decay=0.1)` inside `DistributedOptimizer`, a LambdaLR warm-up +
  cosine schedule stepped after every step, and clipping of the averaged
  gradient: `opt.synchronize(); clip_grad_norm_(..., 1.0); with
  opt.skip_synchronize(): opt.step()`.
* Keras: `keras.optimizers.AdamW` with the same settings, a
  LearningRateSchedule of the same shape and `global_clipnorm=1.0`, inside
  `pipe_horovod.keras.DistributedOptimizer`, trained by `model.fit` with
  BroadcastGlobalVariablesCallback and PipelineFlushCallback, validation by
  fit's own `validation_data`. `--schedule` (Keras's built-in CosineDecay with
  warm-up, ExponentialDecay, PiecewiseConstantDecay, a constant: keras_schedule),
  `--clipping` (global_clipnorm, clipnorm, none) and `--weight-decay` (0: Adam)
  change what Keras's optimizer does around its rule; `--sweep` runs a design of
  such cells (convergence_sweep.py).

Each rank draws its own random windows of the training text (NumPy
generator seeded with (seed, rank), the same for every configuration and
both frameworks). Every `--eval-every` steps the pipeline is flushed (every
computed gradient applied, as PipelineFlushCallback does before fit
validates) and the validation loss recorded.

Run: `pipe-horovod convergence-lm --frameworks torch,keras-tf,keras-torch` (or
`python -m pipe_horovod.tools.bench.convergence_lm ...`): 2 workers per framework on
loopback (torch.distributed.run), outputs docs/convergence/lm.{md,png} and
lm-<framework>-raw.json. The worker is the same module with `--worker`.
"""
import argparse
import functools
import glob
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .lm_settings import (CLIPPINGS, FRAMEWORKS, INITS, SCHEDULES, TARGET,  # noqa: F401
                          Settings)

REPO = Path(__file__).resolve().parents[3]
FORMAT = "pipe_horovod.convergence_lm/1"
CONFIGS = ("sync", "k2-lookahead", "k2")
LABELS = {"sync": "sync (K=1)", "k2-lookahead": "default (K=2, lookahead)",
          "k2": "plain K=2 (staleness_compensation=None)"}
# Not in the default list: the default with a codec on the engine's own collectives
# (the two-stage quantized allreduce: int8_ef, int4_ef), the codec's block size
# after a colon if not the default's: k2-lookahead-int8_ef, k2-lookahead-int4_ef:64.
CODEC_CONFIG = "k2-lookahead-"
ENGINES = ("torch", "horovod")    # torch.distributed.run / horovodrun --gloo (PyTorch only)


def label(config):
    """A configuration's words in the reports."""
    if config.startswith(CODEC_CONFIG):
        return f"default + {config[len(CODEC_CONFIG):]} (engine path, no collective=)"
    return LABELS[config]


# ------------------------------------------------------------------------ data

VOCAB = 96                       # '\n', chr(32)..chr(126)


@functools.lru_cache(maxsize=4)
def corpus(n_chars):
    """The first n_chars of the stdlib's top-level sources, as int32 codes in [0, VOCAB)."""
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        parts.append(text)
        total += len(text)
        if total >= n_chars:
            break
    text = "".join(parts)[:n_chars]
    if len(text) < n_chars:
        raise RuntimeError(f"the standard library holds {len(text)} characters of top-level "
                           f"sources, fewer than the {n_chars} asked for")
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int32)
    codes = np.where(codes == 9, 32, codes)                   # tab -> space
    out = np.where(codes == 10, 0, codes - 31)                # '\n' -> 0, ' '..'~' -> 1..95
    return np.where((out < 0) | (out >= VOCAB), ord("?") - 31, out).astype(np.int32)


def data(s):
    """(train codes, val inputs (W, C), val targets (W, C))."""
    codes = corpus(s.train_chars + s.val_chars)
    train, val = codes[:s.train_chars], codes[s.train_chars:]
    starts = np.linspace(0, len(val) - s.context - 1, s.val_windows).astype(np.int64)
    idx = starts[:, None] + np.arange(s.context + 1)[None, :]
    windows = val[idx]
    return train, windows[:, :-1], windows[:, 1:]


def batches(train, s, seed, rank):
    """(steps, batch, context+1) windows of this rank's training stream."""
    rng = np.random.default_rng([seed, rank])
    starts = rng.integers(0, len(train) - s.context - 1, size=(s.steps, s.batch))
    return train[starts[..., None] + np.arange(s.context + 1)]


def lr_at(s, size, step):
    """Peak lr = lr x size; linear warm-up over `warmup` steps, cosine to min_lr_ratio."""
    peak = s.lr * size
    if step < s.warmup:
        return peak * (step + 1) / s.warmup
    progress = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return peak * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------- torch

def torch_model(s):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(s.d_model), nn.LayerNorm(s.d_model)
            self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
            self.proj = nn.Linear(s.d_model, s.d_model)
            self.fc1 = nn.Linear(s.d_model, 4 * s.d_model)
            self.fc2 = nn.Linear(4 * s.d_model, s.d_model)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, s.heads, d // s.heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class CharTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, s.d_model)
            self.pos = nn.Parameter(torch.randn(s.context, s.d_model) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(s.layers))
            self.ln = nn.LayerNorm(s.d_model)
            self.head = nn.Linear(s.d_model, VOCAB)
            if s.init == "keras":
                self.keras_init()

        def keras_init(self):
            """Keras's glorot_uniform with zero biases, with the fans Keras counts for the
            layers of keras_model: a query/key/value kernel (d_model, heads, head_dim) has
            fan_in heads x d_model and fan_out head_dim x d_model, the attention output's
            (heads, head_dim, d_model) d_model and heads x d_model. So the query and key
            kernels start 2.4x smaller than nn.Linear's (d=128, 4 heads)."""
            d, heads = s.d_model, s.heads

            def glorot(weight, fan_in, fan_out):
                bound = math.sqrt(6 / (fan_in + fan_out))
                nn.init.uniform_(weight, -bound, bound)

            for block in self.blocks:
                glorot(block.qkv.weight, heads * d, d // heads * d)
                glorot(block.proj.weight, d, heads * d)
                glorot(block.fc1.weight, d, 4 * d)
                glorot(block.fc2.weight, 4 * d, d)
            glorot(self.head.weight, d, VOCAB)
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.zeros_(module.bias)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[:idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return CharTransformer()


def _exchange(s, option):
    """The run's prediction_exchange argument: the setting's where the configuration
    predicts (none elsewhere); without a setting, none (the adapter's default)."""
    if s.exchange is None:
        return {}
    return {"prediction_exchange": s.exchange if option == "lookahead" and s.exchange != "none"
            else None}


def train_torch(s, config, seed, rank, size, train, val, on_eval):
    """One run of the PyTorch adapter; returns {"steps": [...], "val_loss": [...]}."""
    import torch
    import torch.nn.functional as F

    import pipe_horovod.torch as phvd
    from pipe_horovod.tools.bench.convergence_worker import config_compression, config_settings

    depth, option = config_settings(config)
    torch.manual_seed(seed)
    model = torch_model(s)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr * size, betas=(s.beta1, s.beta2),
                            weight_decay=s.weight_decay)
    opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    pipeline_depth=depth, staleness_compensation=option,
                                    **_exchange(s, option),
                                    compression=phvd.Compression.by_name(
                                        config_compression(config)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_at(s, size, t) / (s.lr * size))
    phvd.broadcast_parameters(model.state_dict(), root_rank=0)
    phvd.broadcast_optimizer_state(opt, root_rank=0)
    xs = torch.from_numpy(batches(train, s, seed, rank)).long()
    vx, vy = torch.from_numpy(val[0]).long(), torch.from_numpy(val[1]).long()
    hist = {"steps": [], "val_loss": [], "train_loss": []}
    running = 0.0
    for step in range(s.steps):
        x, y = xs[step, :, :-1], xs[step, :, 1:]
        opt.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        with opt.skip_synchronize():
            opt.step()
        sched.step()
        running += loss.item()
        if (step + 1) % s.eval_every == 0 or step + 1 == s.steps:
            opt.flush()
            with torch.no_grad():
                v = F.cross_entropy(model(vx).reshape(-1, VOCAB), vy.reshape(-1)).item()
            n = (step % s.eval_every) + 1
            hist["steps"].append(step + 1)
            hist["val_loss"].append(v)
            hist["train_loss"].append(running / n)
            running = 0.0
            on_eval(step + 1, v)
    with torch.no_grad():
        checksum = float(sum(p.double().sum().item() for p in model.parameters()))
    return hist, checksum


# ----------------------------------------------------------------------- keras

def keras_model(keras, s):
    from keras import layers, ops

    class TokenAndPosition(layers.Layer):
        def build(self, input_shape):
            self.tok = self.add_weight(shape=(VOCAB, s.d_model), name="tok",
                                       initializer=keras.initializers.RandomNormal(stddev=1.0))
            self.pos = self.add_weight(shape=(s.context, s.d_model), name="pos",
                                       initializer=keras.initializers.RandomNormal(stddev=0.02))

        def call(self, idx):
            return ops.take(self.tok, idx, axis=0) + self.pos[:ops.shape(idx)[1]]

    if s.init not in INITS:
        raise ValueError(f"unknown init {s.init!r}; choose from {', '.join(INITS)}")
    # "torch": U(+-1/sqrt(fan_in)), nn.Linear's kernel bound, for every Dense and attention
    # kernel (Keras counts a 3-D query/key/value kernel's fan_in as heads x d_model); the
    # biases stay zero. "own" and "keras": Keras's glorot_uniform.
    init = ({"kernel_initializer": keras.initializers.VarianceScaling(1 / 3, "fan_in",
                                                                       "uniform")}
            if s.init == "torch" else {})
    inp = keras.Input((s.context,), dtype="int32")
    x = TokenAndPosition()(inp)
    for _ in range(s.layers):
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        h = layers.MultiHeadAttention(s.heads, s.d_model // s.heads, **init)(
            h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        h = layers.Dense(4 * s.d_model, activation="gelu", **init)(h)
        x = x + layers.Dense(s.d_model, **init)(h)
    x = layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(inp, layers.Dense(VOCAB, **init)(x))


def keras_schedule(keras, s, size):
    """The learning rate a Keras user passes, peak lr x size, by `s.schedule`:

    * warmup-cosine: a LearningRateSchedule of lr_at's shape (linear warm-up over
      `warmup` steps, cosine to min_lr_ratio of the peak), as the PyTorch run's LambdaLR;
    * cosine: Keras's own CosineDecay with warm-up as its documentation shows it: from
      0 up to the peak over `warmup` steps, then cosine over the rest down to 0;
    * exponential: ExponentialDecay halving every quarter of the run (peak / 16 at the end);
    * piecewise: PiecewiseConstantDecay, the peak, / 4 from half-way, / 16 from
      three quarters;
    * constant: the peak as a float (Keras keeps it in a variable).
    """
    peak, schedules = s.lr * size, keras.optimizers.schedules
    if s.schedule == "cosine":
        return schedules.CosineDecay(0.0, max(1, s.steps - s.warmup), alpha=0.0,
                                     warmup_target=peak, warmup_steps=s.warmup)
    if s.schedule == "exponential":
        return schedules.ExponentialDecay(peak, max(1, s.steps // 4), 0.5)
    if s.schedule == "piecewise":
        return schedules.PiecewiseConstantDecay([s.steps // 2, 3 * s.steps // 4],
                                                [peak, peak / 4, peak / 16])
    if s.schedule == "constant":
        return peak
    if s.schedule != "warmup-cosine":
        raise ValueError(f"unknown schedule {s.schedule!r}; choose from {', '.join(SCHEDULES)}")

    class WarmupCosine(schedules.LearningRateSchedule):
        def __call__(self, step):
            ops = keras.ops
            step = ops.cast(step, "float32")
            warm = peak * (step + 1.0) / s.warmup
            progress = ops.minimum(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
            cos = peak * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5
                          * (1.0 + ops.cos(math.pi * progress)))
            return ops.where(step < s.warmup, warm, cos)

    return WarmupCosine()


def keras_optimizer(keras, s, size):
    """The user's Keras optimizer: AdamW (Adam where weight_decay is 0) with the schedule,
    betas and clipping of `s`."""
    if s.clipping not in CLIPPINGS:
        raise ValueError(f"unknown clipping {s.clipping!r}; choose from {', '.join(CLIPPINGS)}")
    clip = {"global": {"global_clipnorm": s.clip}, "norm": {"clipnorm": s.clip}, "none": {}}
    kwargs = dict(learning_rate=keras_schedule(keras, s, size), beta_1=s.beta1, beta_2=s.beta2,
                  **clip[s.clipping])
    if s.weight_decay:
        return keras.optimizers.AdamW(weight_decay=s.weight_decay, **kwargs)
    return keras.optimizers.Adam(**kwargs)


def train_keras(s, config, seed, rank, size, train, val, on_eval, flush=True,
                unclipped=False):
    """One run of the Keras adapter (model.fit); returns the same record as train_torch.
    flush=False leaves PipelineFlushCallback out: fit then validates at the weights the
    optimizer left in the model (with lookahead: the predicted ones). unclipped: see
    predict_unclipped."""
    import keras

    import pipe_horovod.keras as hvd
    from pipe_horovod.tools.bench.convergence_worker import config_compression, config_settings

    depth, option = config_settings(config)
    keras.utils.set_random_seed(seed)
    model = keras_model(keras, s)

    opt = hvd.DistributedOptimizer(keras_optimizer(keras, s, size),
                                   pipeline_depth=depth, staleness_compensation=option,
                                   **_exchange(s, option), flush_in_fit=flush,
                                   compression=hvd.Compression.by_name(config_compression(config)))
    if unclipped:
        predict_unclipped(opt)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    xs = batches(train, s, seed, rank)
    x, y = xs[:, :, :-1].reshape(-1, s.context), xs[:, :, 1:].reshape(-1, s.context)
    hist = {"steps": [], "val_loss": [], "train_loss": []}

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            step = (epoch + 1) * s.eval_every
            hist["steps"].append(step)
            hist["val_loss"].append(float(logs["val_loss"]))
            hist["train_loss"].append(float(logs["loss"]))
            on_eval(step, float(logs["val_loss"]))

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    if flush:
        callbacks.append(hvd.callbacks.PipelineFlushCallback())
    callbacks.append(Record())
    if s.steps % s.eval_every:
        raise ValueError("Keras runs need steps to be a multiple of eval_every (one fit epoch "
                         "per evaluation)")
    epochs = s.steps // s.eval_every
    # One fit epoch = the next eval_every batches of the stream, in order: with arrays and
    # steps_per_epoch, fit goes on through the arrays from epoch to epoch on both backends.
    # (A PyDataset counting epochs in on_epoch_end is off by one: Keras calls it before the
    # first epoch, so the last epoch would read past the end, on empty batches.)
    model.fit(x, y, batch_size=s.batch, epochs=epochs, steps_per_epoch=s.eval_every,
              shuffle=False, verbose=0, callbacks=callbacks,
              validation_data=(val[0], val[1]), validation_batch_size=len(val[0]))
    if not flush:
        # What fit's last validation saw vs the real weights with every gradient applied:
        # separates "validated at predicted weights" from "trained worse".
        opt.flush()
        hist["final_flushed_val_loss"] = float(model.evaluate(
            val[0], val[1], batch_size=len(val[0]), verbose=0))
    checksum = float(sum(np.asarray(keras.ops.convert_to_numpy(w), np.float64).sum()
                         for w in model.weights))
    return hist, checksum


def predict_unclipped(opt):
    """A check of one difference between the adapters: Keras's lookahead predicts by
    the optimizer's own apply(), which clips this rank's *local* gradient (global_clipnorm
    or clipnorm), while the PyTorch prediction uses the unclipped local gradient (users
    clip the averaged one after synchronize()). This makes the prediction of the Keras
    DistributedOptimizer `opt` unclipped too (the real update still clips), on whichever
    backend is in use, through its prediction_scope, to measure what it does."""
    import contextlib

    @contextlib.contextmanager
    def unclipped():
        saved = opt.global_clipnorm, opt.clipnorm
        opt.global_clipnorm = opt.clipnorm = None
        try:
            yield
        finally:
            opt.global_clipnorm, opt.clipnorm = saved

    opt.prediction_scope = unclipped


# ---------------------------------------------------------------------- worker

def worker(args):
    s = Settings(**json.loads(args.settings))
    if args.framework == "torch":
        import torch
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        import pipe_horovod.torch as hvd
        train_fn = train_torch
    else:
        os.environ["KERAS_BACKEND"] = "tensorflow" if args.framework == "keras-tf" else "torch"
        if args.framework == "keras-tf":            # the torch backend needs no TensorFlow
            import tensorflow as tf
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        import torch
        torch.set_num_threads(1)
        import pipe_horovod.keras as hvd
        train_fn = functools.partial(train_keras, flush=not args.no_flush,
                                     unclipped=args.predict_unclipped)
    from pipe_horovod.tools.bench.worker import Progress, write_json

    hvd.init()
    from pipe_horovod import engine as phvd_engine
    rank, size = hvd.rank(), hvd.size()
    train, vx, vy = data(s)
    configs = args.configs.split(",")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    evals = -(-s.steps // s.eval_every)
    progress = Progress(args.progress, len(seeds) * len(configs) * evals, rank == 0)
    raw = {"format": FORMAT, "framework": args.framework, "engine": phvd_engine.current().name,
           "flush": not args.no_flush,
           "predict_unclipped": args.predict_unclipped,
           "settings": asdict(s), "workers": size, "configs": configs, "seeds": seeds,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}
    for seed in seeds:
        for config in configs:
            def on_eval(step, v, config=config, seed=seed):
                progress.done += 1
                progress.write(f"{args.framework} seed {seed} {config} step {step} val {v:.3f}")
            start = time.perf_counter()
            hist, checksum = train_fn(s, config, seed, rank, size, train, (vx, vy), on_eval)
            sums = hvd.allgather_object(checksum)
            raw["runs"].append({"config": config, "seed": seed, **hist,
                                "train_time_s": time.perf_counter() - start,
                                "ranks_agree": all(c == sums[0] for c in sums)})
            if rank == 0:
                print(f"[lm] {args.framework} seed {seed} {config:>12}: final val "
                      f"{hist['val_loss'][-1]:.4f} in {time.perf_counter() - start:.0f} s",
                      flush=True)
                if args.out:
                    write_json(args.out, raw)
    progress.write("done")
    hvd.shutdown()
    return 0


# ---------------------------------------------------------------------- report

def summarize(raw):
    rows = {}
    for config in raw["configs"]:
        runs = [r for r in raw["runs"] if r["config"] == config]
        if not runs:
            continue
        finals = [r["val_loss"][-1] for r in runs]
        curves = [r["val_loss"] for r in runs]
        flushed = [r["final_flushed_val_loss"] for r in runs if "final_flushed_val_loss" in r]
        rows[config] = {"final_mean": statistics.fmean(finals),
                        "flushed_mean": statistics.fmean(flushed) if flushed else None,
                        "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                        "finals": finals, "seeds": [r["seed"] for r in runs],
                        "steps": runs[0]["steps"],
                        "curve": [statistics.fmean(c) for c in zip(*curves)],
                        "train_time_s": statistics.fmean(r["train_time_s"] for r in runs),
                        "ranks_agree": all(r["ranks_agree"] for r in runs)}
    return rows


def markdown(raws, command):
    lines = [f"Command: `{command}`", "",
             "| framework | configuration | final val loss (mean ± std) | per seed | "
             "vs sync | s/run |", "|---|---|---|---|---|---|"]
    for raw in raws:
        rows = summarize(raw)
        sync = rows.get("sync", {}).get("final_mean")
        name = raw["framework"] + (
            " (horovod engine)" if raw.get("engine") == "horovod" else "") + (
            "" if raw.get("flush", True) else " (no flush)") + (
            " (prediction unclipped)" if raw.get("predict_unclipped") else "")
        for config, r in rows.items():
            delta = "" if sync is None or config == "sync" else f"{r['final_mean'] - sync:+.4f}"
            lines.append(f"| {name} | {label(config)} | {r['final_mean']:.4f} ± "
                         f"{r['final_std']:.4f} | {' / '.join(f'{v:.4f}' for v in r['finals'])}"
                         f" | {delta} | {r['train_time_s']:.0f} |")
            if r["flushed_mean"] is not None:
                lines.append(f"| {name} | {label(config)}, after fit + flush() | "
                             f"{r['flushed_mean']:.4f} | | | |")
    return "\n".join(lines)


def plot(raws, path):
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(1, len(raws), figsize=(5.5 * len(raws), 4.2), squeeze=False)
    for ax, raw in zip(axes[0], raws):
        for config, r in summarize(raw).items():
            ax.plot(r["steps"], r["curve"], marker=".", label=label(config))
        ax.set_title(f"{raw['framework']}: char transformer, AdamW, {raw['workers']} ranks")
        ax.set_xlabel("step")
        ax.set_ylabel(f"validation loss (mean of {len(raw['seeds'])} seeds)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 3.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- launch

def _suffix(args):
    return ("-noflush" if args.no_flush else "") + ("-unclipped" if args.predict_unclipped else "")


def launch(args, framework, s, out_dir):
    from pipe_horovod.tools.launch import run_files, worker_env
    from pipe_horovod.tools.emulate import read_progress

    raw_path, progress_path, log_path = run_files(out_dir,
                                                  f"{args.name}-{framework}{_suffix(args)}")
    if args.engine == "horovod":
        from pipe_horovod.tools.launch import horovodrun
        n = str(args.workers)
        cmd = [horovodrun(), "-np", n, "-H", f"localhost:{n}", "--gloo", sys.executable]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(args.workers)]
    cmd += ["-m", "pipe_horovod.tools.bench.convergence_lm", "--worker",
            "--framework", framework, "--configs", args.configs, "--seeds", str(args.seeds),
            "--first-seed", str(args.first_seed), "--settings", json.dumps(asdict(s)),
            "--out", raw_path, "--progress", progress_path]
    if args.no_flush:
        cmd.append("--no-flush")
    if args.predict_unclipped:
        cmd.append("--predict-unclipped")
    from tqdm import tqdm
    total = args.seeds * len(args.configs.split(",")) * -(-s.steps // s.eval_every)
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, desc=framework, unit="eval", file=sys.stderr, dynamic_ncols=tty,
               ncols=None if tty else 100, mininterval=0.1 if tty else 10)
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO)
        while proc.poll() is None:
            time.sleep(1.0)
            state = read_progress(progress_path)
            if state and state["done"] > bar.n:      # a line per change, not per poll
                bar.set_postfix_str(state.get("current", ""), refresh=False)
                bar.update(min(state["done"], total) - bar.n)
    bar.close()
    if proc.returncode != 0 or not os.path.exists(raw_path):
        raise SystemExit(f"{framework}: workers failed (exit {proc.returncode}); see {log_path}")
    if os.path.exists(progress_path):
        os.remove(progress_path)
    with open(raw_path) as f:
        return json.load(f)


def add_arguments(p):
    """The options of `pipe-horovod convergence-lm` (and of this module run directly)."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", default="torch", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--frameworks", default="torch",
                   help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default torch)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated (default {','.join(CONFIGS)}): sync = pipeline_depth 1, "
                        "k2 = pipeline_depth 2 without compensation, k2-lookahead = the default; "
                        "also k2-lookahead-int8_ef / -int4_ef[:BLOCK] = the default with that "
                        "compression (and block size) on the engine's own collectives")
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N per configuration (default 3)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=Settings.steps,
                   help=f"steps per run (default {Settings.steps}; Keras: a multiple of "
                        f"{Settings.eval_every})")
    p.add_argument("--schedule", choices=SCHEDULES, default=Settings.schedule,
                   help="Keras: the learning-rate schedule (keras_schedule says each; default "
                        f"{Settings.schedule}, the PyTorch run's shape)")
    p.add_argument("--clipping", choices=CLIPPINGS, default=Settings.clipping,
                   help="Keras: global_clipnorm, clipnorm or no clipping (default global)")
    p.add_argument("--init", choices=INITS, default=Settings.init,
                   help="the kernels' initializer: each framework's own (default), Keras's "
                        "glorot_uniform with zero biases, or PyTorch's nn.Linear bound "
                        "1/sqrt(fan_in), in either model (keras_model, torch_model)")
    p.add_argument("--weight-decay", type=float, default=Settings.weight_decay,
                   help=f"AdamW's weight decay (default {Settings.weight_decay}); Keras: 0 "
                        "trains with Adam")
    p.add_argument("--d-model", type=int, default=Settings.d_model,
                   help=f"the transformer's width (default {Settings.d_model})")
    p.add_argument("--exchange", choices=("int4", "int8", "none"),
                   help="the lookahead configurations' prediction_exchange (the prediction "
                        "from the ranks' average exchanged in that format; none: from the "
                        "rank's own gradient; default: the adapter's, int4 on Keras, none "
                        "on PyTorch)")
    p.add_argument("--sweep",
                   help="Keras: run the cells of a design (issue36) or of a list "
                        "framework:schedule:clipping:weight_decay:steps,... (sync and the "
                        "default, --seeds each) and report the default's gap per cell "
                        "(convergence_sweep.py)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engine", choices=ENGINES, default="torch",
                   help="PyTorch's engine: torch = torch.distributed.run (default), horovod = "
                        "horovodrun --gloo; the Keras frameworks always use torch.distributed.run")
    p.add_argument("--no-flush", action="store_true",
                   help="Keras: no PipelineFlushCallback (fit validates at the weights the "
                        "optimizer left in the model)")
    p.add_argument("--predict-unclipped", action="store_true",
                   help="Keras: the lookahead's prediction without global_clipnorm (checks what "
                        "clipping the local gradient does to it; the real update still clips)")
    p.add_argument("--out", default="docs/convergence")
    p.add_argument("--name", default="lm", help="file stem of the outputs (default lm)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild <name>.md/.png from <out>/<name>-<framework>-raw.json")


def _codec_config(config):
    from pipe_horovod.tools.bench.convergence_worker import parse_configs

    try:
        return config.startswith(CODEC_CONFIG) and bool(parse_configs(config))
    except ValueError:
        return False


def check_args(args):
    """Raises SystemExit for configurations or an engine a framework cannot run."""
    frameworks = args.frameworks.split(",")
    for framework in frameworks:
        if framework not in FRAMEWORKS:
            raise SystemExit(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    for config in args.configs.split(","):
        if config not in CONFIGS and not _codec_config(config):
            raise SystemExit(f"unknown configuration {config!r}; choose from "
                             f"{', '.join(CONFIGS)}, or {CODEC_CONFIG}CODEC[:BLOCK] with CODEC "
                             "int8_ef or int4_ef")
    if "torch" in frameworks and (args.schedule, args.clipping) != (
            Settings.schedule, Settings.clipping):
        raise SystemExit("--schedule and --clipping are Keras settings; the PyTorch "
                         "run clips the averaged gradient and warms up + cosine (lr_at)")
    if args.engine != "torch" and frameworks != ["torch"]:
        raise SystemExit("--engine horovod runs the PyTorch adapter only (--frameworks torch)")


def run(args, argv=None):
    if args.worker:
        return worker(args)
    if args.sweep:
        from . import convergence_sweep
        return convergence_sweep.run(args, argv, launch)
    if not args.report_only:
        check_args(args)
    s = Settings(steps=args.steps, schedule=args.schedule, clipping=args.clipping,
                 weight_decay=args.weight_decay, d_model=args.d_model, init=args.init,
                 exchange=args.exchange)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    command = shlex.join(["pipe-horovod", "convergence-lm", *(
        argv if argv is not None else sys.argv[1:])])
    raws = []
    for framework in args.frameworks.split(","):
        suffix = _suffix(args)
        if args.report_only:
            with open(os.path.join(out_dir, f"{args.name}-{framework}{suffix}-raw.json")) as f:
                raws.append(json.load(f))
        else:
            raws.append(launch(args, framework, s, out_dir))
    text = markdown(raws, command)
    with open(os.path.join(out_dir, f"{args.name}.md"), "w") as f:
        f.write(text + "\n")
    plot(raws, os.path.join(out_dir, f"{args.name}.png"))
    print(text)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
