"""The pipelined data path between an adapter and the engine: one object per wrapped optimizer.

Adapters (PyTorch hooks, Keras's `apply`) know where gradients live; the
step machine knows what happens to them once they are flat engine tensors
(torch tensors, whatever the framework, since the engines are torch's and
Horovod's): which bucket they belong to, when a bucket goes on the wire and
under which name, which K-slot buffer it is reduced in, when the FIFO hands
a step's average back, and what a checkpoint must carry.

Per step an adapter calls `ready(name, fill)` as each gradient is final
(from any thread), `finish_step(scale)` at step(), and applies what that
returns; `drain()` hands back the rest (flush). `fill(bucket, flat)`
writes the bucket's gradients into the flat buffer the machine owns.

With `exchange` (the lookahead's `prediction_exchange`: "int4" or "int8"), each
bucket of a step that will be in flight first goes out quantized, on the
two-stage path, for the prediction (`estimates()`); the buckets' own
reductions start only at `launch_rest()`, after every exchange, so that no
exchange waits behind a full-size reduction on the same link: they then
overlap the next step's compute alone (at K=2, the step Pipe-SGD gives them).

With `tune` (a pipeline/auto.py Tuner: the adapters' tune="auto"), the machine decides
its own depth, codec and bucket cap at the step boundary after its measured steps
(`_tune`), applies the decision there for every adapter alike (`_apply_tuning`), tells
the adapter through what it gave `tell_when_tuned`, and carries the decision in its state.
"""
import functools
import logging
import threading
import time
import weakref

from .. import collectives, engine
from ..collectives import quantized
from ..collectives.communicator import communicator
from ..compression import Compression, config_name, two_stage, wire_format
from ..compression.feedback import ErrorFeedback
from . import auto
from .buckets import plan_buckets
from .fifo import GradientFifo
from .run_record import RunRecord, write_at_exit
from .timing_model import MIB

_log = logging.getLogger("pipe_horovod")


class BucketReduction:
    """One bucket of one step: its flat tensor on the wire, or the landed result."""

    __slots__ = ("bucket", "step", "handle", "ctx", "compression", "result", "record")

    def __init__(self, bucket, step, handle, ctx, compression):
        self.bucket, self.step, self.handle = bucket, step, handle
        self.ctx, self.compression = ctx, compression
        self.result = None
        self.record = None                     # (RunRecord, its entry) once recorded

    def wait(self):
        if self.result is None:
            called = time.perf_counter()
            try:
                landed = engine.wait(self.handle)
            except engine.WaitError as exc:    # say which bucket of which step never landed
                raise type(exc)(f"waiting for {self.describe()}: {exc}") from exc
            if self.record is not None:
                record, entry = self.record
                record.landed(entry, called, time.perf_counter())
            self.result = self.compression.decompress(landed, self.ctx)
            self.handle = None
        return self.result

    def describe(self):
        names = self.bucket.names
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        return (f"the gradients of step {self.step}, bucket {self.bucket.index} "
                f"({len(names)} parameter(s): {shown})")

    def results(self):
        flat = self.wait()
        for name, start, numel in self.bucket.offsets():
            yield name, flat[start:start + numel]


class StepGradient:
    """A step's averaged gradient: its reductions, or per-name tensors.

    `loaded` holds tensors that need no reduction: read from a checkpoint,
    a lone rank's own gradients, or (beside reductions) the gradients of
    variables kept local to the rank. `scale` is what the adapter needs to
    interpret them later (a GradScaler's scale at compute time); `kept`
    what a staleness compensation keeps with the step ({kind: {name: tensor}}:
    this rank's own gradient, the weights it was computed at).
    """

    __slots__ = ("reductions", "loaded", "scale", "kept")

    def __init__(self, reductions=(), loaded=None, scale=None, kept=None):
        self.reductions = list(reductions)
        self.loaded = loaded
        self.scale = scale
        self.kept = kept or {}

    def gradients(self):
        """{name: flat averaged gradient}; waits for reductions still on the wire."""
        if not self.reductions:
            return self.loaded if self.loaded is not None else {}
        grads = dict(self.loaded or {})
        for reduction in self.reductions:
            grads.update(reduction.results())
        return grads


class StepMachine:
    def __init__(self, prefix, pipeline_depth, warmup_steps, *, compression=Compression.none,
                 op=engine.Average, predivide=1.0, process_set=None, cap_bytes=25 * 2**20,
                 groups=None, collective=None, exchange=None, tune=None):
        self.prefix = prefix                  # tensor names: the same on every rank
        self.fifo = GradientFifo(pipeline_depth, warmup_steps)
        self.op = op
        self.predivide = predivide
        self.process_set = process_set        # None: every rank
        self.cap_bytes = cap_bytes
        self.groups = groups                  # None, a bucket count, or lists of names
        # A pipe_horovod.collectives.Collective runs the codec per hop; None: the
        # engine's allreduce of the compressed tensor.
        self.collective = collective
        self._use_compression(compression)
        # tune="auto": a pipeline/auto.py Tuner; on_tuned: the adapter's bound methods
        # (tell_when_tuned), each called with the Decision once it is applied.
        self.tuner = tune
        self.on_tuned = []
        if tune is not None and tune.initial_cap_bytes is None:
            tune.initial_cap_bytes = cap_bytes
        # None, or the prediction's wire format (staleness.EXCHANGES)
        self.exchange = None if exchange is None else two_stage.WireFormat(exchange)
        # Autograd runs CPU and CUDA leaves (or several GPUs') on different
        # threads: claiming and launching the next bucket must be atomic.
        self._lock = threading.Lock()
        self.buckets, self.bucket_of = [], {}
        self._buffers = {}
        # The adapter's `timings` (it adds its own keys); the record keeps the measured
        # step in it (pipeline/run_record.py). None: nothing recorded.
        self.timings = {"steps": 0, "wait_s": 0.0, "applied": 0}
        self.record = RunRecord(self.timings, self.run_config)
        self.attach()
        self.begin_step()

    def _use_compression(self, compression):
        self.compression = compression
        # A codec that quantizes inside the reduction, with no collective=: two stages
        # on the engine's own alltoall and allgather (collectives/quantized.py).
        self.wire = wire_format(compression) if self.collective is None else None
        if self.wire is not None and self.op not in (engine.Average, engine.Sum):
            raise ValueError(f"compression {compression.name!r} reduces with Average or Sum "
                             f"only (it sums dequantized shards), got op={self.op}")
        before = getattr(self, "feedback", None)
        self.feedback = ErrorFeedback() if getattr(compression, "error_feedback", False) else None
        # Going back from a codec with error feedback: its residuals are added to the
        # next reductions without it (ErrorFeedback.fold_into), so nothing is lost.
        self._folding = before if self.feedback is None else None

    def attach(self):
        """Use the engine running now (a new one after an elastic reset)."""
        self.engine = engine.current()
        ps = self.process_set
        # A rank outside the process set reduces nothing: as in Horovod, it
        # applies its own gradient (through the same pipeline depth).
        included = ps is None or ps.included()
        self.size = self.engine.size() if ps is None else ps.size() if included else 1
        # Object collectives among the ranks that reduce (checks, agreement).
        # Through allreduces, which a rank that already joined (an empty shard) answers.
        self.gather = (functools.partial(self.engine.gather_despite_join,
                                         name=f"{self.prefix}.agree", process_set=ps)
                       if included else _alone)
        # One rank, no codec, no scaling: averaging is the identity, nothing to send.
        # (The two-stage codecs quantize nothing with one rank.)
        self.solo = not included or (self.size == 1 and self.predivide == 1.0 and (
            self.compression is Compression.none or self.wire is not None))
        rank = self.engine.rank()
        self.engine.before_shutdown("pipe_horovod.run_summary", lambda: write_at_exit(rank))
        if self.tuner is not None:
            decision = self.tuner.decision
            if decision is not None and decision.workers != self.size:
                # Another number of ranks (an elastic reset): what was measured no longer
                # holds; back to the measured configuration, and decide again.
                self._apply_tuning(self.tuner.measuring(), decided=False)
                self.tuner.restart(self.fifo.steps)
            ref = weakref.ref(self)
            self.engine.before_shutdown(f"pipe_horovod.auto.{self.prefix}",
                                        lambda: _say_too_short(ref))

    # --- buckets ----------------------------------------------------------
    def members(self):
        """The planned buckets' members, in ready order, as plan() takes them."""
        return [(name, numel, b.kind[0].itemsize, b.kind) for b in self.buckets
                for name, numel in zip(b.names, b.numels)]

    def plan(self, members):
        """Fuse `members` [(name, numel, element_size, (dtype, device))], in ready order."""
        self.buckets = plan_buckets(members, self.cap_bytes, self.groups)
        self.bucket_of = {name: b for b in self.buckets for name in b.names}
        self._place_of = {name: (start, numel) for b in self.buckets
                          for name, start, numel in b.offsets()}
        # An adapter's gradients may view old buffers at old offsets: a new plan
        # gets new buffers, so no gradient is written over another's.
        self._buffers = {}
        if self.feedback is not None:
            self.feedback.replan()
        self.begin_step()

    def agree(self, seen, rest, extra=None):
        """Rank 0's gradient-ready order (`seen` first, then `rest`), and every rank's `extra`.

        Collectives are matched by name (Horovod) or by order (torch.distributed):
        every rank must launch the same buckets in the same order, so the
        order one rank observed in its first backward becomes everyone's.
        """
        everyone = self.gather((list(seen) + list(rest), extra))
        present = [entry for entry in everyone if entry is not None]    # None: joined
        return present[0][0], [e for _, e in present]

    def buffer(self, bucket):
        """This step's persistent flat buffer for `bucket` (one per pipeline slot)."""
        key = (self.slot, bucket.index)
        flat = self._buffers.get(key)
        if flat is None or flat.numel() != bucket.numel:
            import torch
            dtype, device = bucket.kind
            flat = torch.empty(bucket.numel, dtype=dtype, device=device)
            self._buffers[key] = flat
        return flat

    def part(self, name):
        """The slice of this step's flat buffer that holds `name`'s gradient (None: in no
        bucket): an adapter may let backward's gradient live there, as a view."""
        bucket = self.bucket_of.get(name)
        if bucket is None:
            return None
        start, numel = self._place_of[name]
        return self.buffer(bucket)[start:start + numel]

    @property
    def slot(self):
        return self.fifo.steps % self.fifo.pipeline_depth

    # --- a step -----------------------------------------------------------
    def begin_step(self):
        self._waiting = [len(b.names) for b in self.buckets]
        self._started = 0                     # buckets filled (and exchanged) so far
        self.launched = []                    # BucketReduction per bucket, in bucket order
        self._deferred = []                   # (bucket, flat) to reduce after the exchanges
        self._exchanges = []                  # (bucket, handle) of this step's exchanges
        self._exchanging = self._exchanges_now()

    def _exchanges_now(self):
        """The prediction needs this step's exchange only where the step stays in flight."""
        return (self.exchange is not None and not self.solo
                and self.fifo.threshold(self.fifo.steps) > 1)

    def ready(self, name, fill):
        """`name`'s gradient is final for this step: launch every bucket now complete.

        Buckets start in index order only: torch.distributed matches
        collectives by order, so a later bucket never overtakes an earlier one.
        """
        bucket = self.bucket_of.get(name)
        if bucket is None:
            return
        with self._lock:
            self._waiting[bucket.index] -= 1
            while (not self.solo and self._started < len(self.buckets)
                   and self._waiting[self._started] == 0):
                self._launch(self.buckets[self._started], fill)

    def launch_rest(self, fill):
        """Send every bucket backward did not complete (unused parameters send zeros), then
        the reductions held back behind the exchanges."""
        with self._lock:
            while not self.solo and self._started < len(self.buckets):
                self._launch(self.buckets[self._started], fill)
            for bucket, flat in self._deferred:
                self._reduce(bucket, flat)
            self._deferred = []

    def _launch(self, bucket, fill):
        self.engine.stepping = True     # this rank began a step a rank that ended never did
        self._started += 1
        flat = self.buffer(bucket)
        fill(bucket, flat)
        if not self._exchanging:
            self._reduce(bucket, flat)
            return
        # A copy for this step only: once the adapter has what the prediction reads, no
        # buffer of it outlives the step (the memory between steps stays the default's).
        estimate = flat.clone()
        handle = quantized.allreduce_async(
            estimate, f"{self.prefix}.{bucket.index}.{bucket.numel}.x", self.op,
            fmt=self.exchange, process_set=self.process_set, prescale_factor=1.0 / self.predivide,
            postscale_factor=self.predivide, transport=quantized.bucket_transport(estimate),
            keep_buffers=False)
        self._exchanges.append((bucket, handle))
        self._deferred.append((bucket, flat))

    def estimates(self):
        """{name: flat view of the exchanged average} of this step's gradients (waits, the
        wait counted in timings["exchange_wait_s"]: the timing model's W); empty where the
        step exchanged nothing. Call before finish_step."""
        out, start = {}, time.perf_counter()
        for bucket, handle in self._exchanges:
            try:
                flat = engine.wait(handle)
            except engine.WaitError as exc:
                raise type(exc)(f"waiting for the prediction's exchange of step "
                                f"{self.fifo.steps}, bucket {bucket.index}: {exc}") from exc
            out.update((name, flat[at:at + numel]) for name, at, numel in bucket.offsets())
        if self._exchanges:
            self.timings["exchange_wait_s"] = (self.timings.get("exchange_wait_s", 0.0)
                                               + time.perf_counter() - start)
        self._exchanges = []
        return out

    def _reduce(self, bucket, flat):
        # A name stands for one size: Horovod caches responses by name, and a
        # re-planned bucket reusing a name trips its cache on joined ranks.
        name = f"{self.prefix}.{bucket.index}.{bucket.numel}.{self.slot}"
        # gradient_predivide_factor splits the average around the sum, as Horovod's does.
        scaling = {"process_set": self.process_set, "prescale_factor": 1.0 / self.predivide,
                   "postscale_factor": self.predivide}
        ctx, codec = None, Compression.none      # what the landed result still needs
        if self._folding is not None and not self._folding.fold_into(
                flat, bucket, self.slot, self.fifo.pipeline_depth,
                self.size if self.op is engine.Average else 1):
            self._folding = None
        if self.wire is not None:
            residuals = None
            if self.feedback is not None:       # the second: the shard this rank reduces
                ps = self.process_set
                index = (self.engine.rank() if ps is None
                         else ps.ranks.index(self.engine.rank()))
                residuals = (self.feedback.residual(self.slot, bucket),
                             self.feedback.residual(self.slot, bucket, stage=2, part=(
                                 two_stage.own_shard(bucket.numel, self.size, index))))
            handle = quantized.allreduce_async(flat, name, self.op, fmt=self.wire,
                                               residuals=residuals,
                                               transport=quantized.bucket_transport(flat),
                                               **scaling)
        elif self.collective is not None:
            residual = (None if self.feedback is None
                        else self.feedback.residual(self.slot, bucket))
            handle = collectives.allreduce_async(flat, name, self.op, collective=self.collective,
                                                 compression=self.compression,
                                                 residual=residual, **scaling)
        else:
            wire, ctx = self.compression.compress(flat)
            handle = self.engine.allreduce_async(wire, name, self.op, **scaling)
            codec = self.compression
        reduction = BucketReduction(bucket, self.fifo.steps, handle, ctx, codec)
        self.launched.append(reduction)
        if self.record is not None:             # the measured run (pipeline/run_record.py)
            self.record.launched(reduction, self.fifo.steps)

    # --- the measured run (pipeline/run_record.py) --------------------------
    def run_config(self):
        """What produced the recorded run: a run summary's "config"."""
        def nbytes(bucket):
            return [n * bucket.kind[0].itemsize for n in bucket.numels]
        config = {"pipeline_depth": self.fifo.pipeline_depth,
                  "compression": _codec_name(self.compression),
                  "collective": getattr(self.collective, "algorithm", None),
                  "bucket_cap_bytes": int(self.cap_bytes), "workers": self.size,
                  "model_bytes": sum(sum(nbytes(b)) for b in self.buckets),
                  "buckets": [nbytes(b) for b in self.buckets]}
        if self.tuner is not None:          # tune="auto": what it chose, or that it measures
            decision = self.tuner.decision
            config["auto"] = ({"measuring": self.tuner.steps} if decision is None
                              else decision.as_dict())
        return config

    def write_run_summary(self, path):
        """Rank 0 writes the measured run (RunRecord.summary) to `path`; returns `path`
        there, None on the other ranks (nothing is exchanged)."""
        if self.record is None or self.engine.rank() != 0:
            return None
        return self.record.write(path)

    def finish_step(self, entry):
        """Push this step's `entry` (a StepGradient); return the entries to apply now,
        oldest first."""
        ready = self.fifo.push(entry)
        self.engine.step = self.fifo.steps      # for the stall reports (engine/stall.py)
        self.engine.stepping = False
        if self.record is not None:
            self.record.finished(self.fifo.steps - 1)
        if self.tuner is not None and self.tuner.due(self.fifo.steps):
            self._tune()
            # A trial undone: what the shallower depth no longer holds in flight is
            # applied now, oldest first (the adapter applies several in one step).
            ready += self.fifo.pop_ready()
        self.begin_step()
        return ready

    def drain(self):
        self.say_if_too_short()
        return self.fifo.drain()

    # --- tune="auto" (pipeline/auto.py) ---------------------------------------
    def _first_rank(self):
        return self.engine.rank() == (0 if self.process_set is None
                                      else self.process_set.ranks[0])

    def _tune(self):
        """At the step boundary after the measured steps (or after a trial's): the first
        rank decides from the run record, every rank applies its decision (broadcast
        through the object collective, so all apply the same at the same step)."""
        mine, tuner = None, self.tuner
        trial = tuner.decision                  # None, or a trial to keep or undo
        if self._first_rank():
            try:
                summary = self.record.summary()
                mine = (auto.decide(summary, tuner.pins, may_try=tuner.may_try)
                        if trial is None else
                        auto.confirm(summary, trial, tuner.tried_from, tuner.pins)).as_dict()
            except Exception as exc:        # noqa: BLE001 - the others wait in the gather
                # below: whatever went wrong, this rank answers, and the run stays as run
                mine = auto.unchanged(self.size, f"no decision ({type(exc).__name__}: "
                                      f"{exc})", self.tuner.pins).as_dict()
        everyone = self.gather(mine)
        chosen = next((d for d in everyone if d is not None), None)
        decision = (auto.Decision.from_dict(chosen) if chosen is not None
                    else auto.unchanged(self.size, "no rank decided", self.tuner.pins))
        self._apply_tuning(decision)
        if decision.trying:
            tuner.tried_from = self.fifo.steps
        elif self.record is not None:          # the summary: the chosen configuration's steps
            self.record.begin_anew()
        if not self.solo and opens_group(self.collective, self.compression, self.exchange):
            # A codec that sends point to point needs pipe_horovod's gloo group, opened by
            # every rank at one point: here, where all of them apply the decision (a resume
            # leaves it to the first reduction: rank 0 may load alone).
            communicator(self.engine)
        if self._first_rank():
            auto.log(auto.describe(decision, tuner.trial_steps))

    def _apply_tuning(self, decision, decided=True):
        """Depth, codec and bucket cap of `decision`, at a step boundary (what the FIFO
        pops later follows the new depth; a landed reduction keeps its own codec and
        buffers), then the adapter's callbacks."""
        self.tuner.decision = decision if decided else None
        self.fifo.pipeline_depth = decision.pipeline_depth
        if decision.compression != _codec_name(self.compression):
            self._use_compression(Compression.by_name(decision.compression))
        cap = (self.tuner.initial_cap_bytes if decision.bucket_cap_mb is None
               else int(decision.bucket_cap_mb * MIB))
        if cap is not None and (int(cap) != int(self.cap_bytes) or type(cap) is not type(
                self.cap_bytes)):
            self.cap_bytes = cap
            if self.buckets and self.groups is None:
                self.plan(self.members())
        for ref in list(self.on_tuned):
            callback = ref()
            if callback is not None:
                callback(decision)

    def tell_when_tuned(self, method):
        """Call the bound `method` with each Decision applied (tune="auto"), holding it by
        weak reference: the adapter owns this machine, not the other way round."""
        self.on_tuned.append(weakref.WeakMethod(method))

    def restore_tuning(self, saved, steps):
        """A checkpoint's decision ("tune" in state()), applied without measuring again
        where it was taken for as many ranks as reduce now; else measure from `steps`."""
        if self.tuner is None:
            return
        if saved is not None and saved.get("workers") == self.size:
            self._apply_tuning(auto.Decision.from_dict(saved))
            self.tuner.tried_from = steps        # a trial saved: tried again from here
            return
        if self.tuner.decision is not None:
            self._apply_tuning(self.tuner.measuring(), decided=False)
        self.tuner.restart(steps)

    def say_if_too_short(self):
        """Once, on the first rank: the run stops (flush, state taken, exit) before auto
        decided, so it trained as measured throughout. Not before the first measured step:
        the ranks' agreement at the start (resume_agreement) reads the state then, and
        nothing has ended early."""
        if self.tuner is None or self.fifo.steps == self.tuner.measure_from:
            return
        words = self.tuner.too_short(self.fifo.steps)
        if words is not None and self._first_rank():
            auto.log(words)

    def release(self, entry):
        """Let go of the slot buffers `entry`'s reductions landed in, once the adapter has
        its gradients elsewhere: that slot allocates again at its next use. For a data path
        whose framework keeps no gradient between steps (Keras on TensorFlow), so that
        between steps only the slots still in flight hold memory; a tensor still viewing
        a released buffer keeps it alive until it goes."""
        for reduction in entry.reductions:
            key = (reduction.step % self.fifo.pipeline_depth, reduction.bucket.index)
            self._buffers.pop(key, None)

    # --- checkpoints --------------------------------------------------------
    def state(self):
        """What a checkpoint carries: waits for (local) reductions still in flight."""
        self.say_if_too_short()
        tuned = {} if self.tuner is None else {
            "tune": None if self.tuner.decision is None else self.tuner.decision.as_dict()}
        return {"steps": self.fifo.steps, **tuned,
                "in_flight": [{n: g.detach().clone() for n, g in e.gradients().items()}
                              for e in self.fifo],
                "scales": [e.scale for e in self.fifo],
                "kept": [{kind: {n: t.detach().clone() for n, t in tensors.items()}
                          for kind, tensors in e.kept.items()} for e in self.fifo],
                "error_feedback": next((f.state() for f in (self.feedback, self._folding)
                                        if f is not None), None)}

    def settle(self):
        """Complete every reduction in flight: the other ranks started them too, and
        their names must be free before the same names are used again."""
        for entry in self.fifo:
            entry.gradients()

    def adopts(self):
        """Whether a checkpoint's gradients in flight are taken beyond what the depth
        holds: tune="auto" measuring at K=1, from a checkpoint without a decision (a fixed
        pipelined run's), on an adapter that applies several in one step (as where a trial
        is undone). They pop at the next step with that step's own; nothing is dropped."""
        tuner = self.tuner
        return tuner is not None and tuner.decision is None and tuner.may_try

    def restore(self, in_flight, scales, steps, kept=None, error_feedback=None):
        """Replace what is in flight by a checkpoint's (call settle() first)."""
        if self.feedback is not None:
            self.feedback.load(error_feedback)
        else:                                   # residuals without their codec: folded
            self._folding = ErrorFeedback() if error_feedback else None
            if self._folding is not None:
                self._folding.load(error_feedback)
        kept = kept or [None] * len(in_flight)
        depth = self.fifo.pipeline_depth
        if self.adopts():
            self.fifo.pipeline_depth = max(depth, len(in_flight) + 1)
        try:
            self.fifo.replace([StepGradient(loaded=grads, scale=scale, kept=k)
                               for grads, scale, k in zip(in_flight, scales, kept)], steps)
        finally:
            self.fifo.pipeline_depth = depth
        # The next step is `steps`, maybe at another depth (a restored tune="auto"
        # decision): whether it exchanges follows them, not the step it was built at.
        self._exchanging = self._exchanges_now()

    def forget(self):
        """Drop, without waiting, everything in flight (after a failed collective)."""
        self.fifo.replace([], self.fifo.steps)
        self.begin_step()


def opens_group(collective, compression, exchange=None):
    """Whether the buckets may send on pipe_horovod's own gloo group (per hop, or a
    codec's two stages point to point, the prediction's exchange included), which every
    rank must open at one point: the adapters open it where they wrap (the first
    reduction would open it otherwise)."""
    return (collective is not None or wire_format(compression) is not None
            or exchange is not None)


def _codec_name(compression):
    """The name Compression.by_name reads back; a user's own compressor by its name."""
    try:
        return config_name(compression)
    except (AttributeError, ValueError):
        return getattr(compression, "name", type(compression).__name__)


def _say_too_short(ref):
    machine = ref()
    if machine is not None:
        machine.say_if_too_short()


def _alone(obj, name=None):
    """allgather_object for a rank that shares no collective with others (`name`: the
    collective's, as the others' gather takes it)."""
    return [obj]
