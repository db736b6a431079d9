"""Ranks must start each collective with the same arguments: checked once per call signature.

A rank that passes another size (or dtype, op, algorithm, codec, root)
than its peers would post receives of other sizes, and gloo aborts the
process in C++. So a signature (what the algorithm's messages depend on)
is exchanged with every peer the first time it is used and compared; a
difference raises ValueError on every rank, naming each rank's value.
A check passes or fails on every rank alike, so the lists of verified
signatures stay the same on every rank and a verified one costs nothing
(a dict lookup): the steady state of a training loop sends no extra byte.

Ranks that disagree while some repeat verified signatures cannot see it
without a message, so that case is made harmless instead: a verified
signature's index goes into the messages' tags (channel.SIGNATURE_BITS),
so two different verified calls never exchange a byte, and a rank whose
call is new waits for check answers its peers never send. Each then stops
at the group's timeout (PIPE_HOROVOD_TIMEOUT), not with a crash in gloo: a
rank whose call is new with ValueError (its check got no answer), a rank in
a verified call with WaitTimeoutError naming that call (communicator.py:
from inside the algorithm a wait that times out cannot tell these ranks from
a peer that hangs, and a hang must reset elastic training).
"""
import json

from .channel import MESSAGE_BITS

# The message id of the check, above every algorithm's ids (they stay below it).
CHECK_MESSAGE = (1 << MESSAGE_BITS) - 1
SIGNATURE_BYTES = 512
FIELDS = ("kind", "numel", "dtype", "op", "collective", "codec", "root")


def signature(job):
    """What every rank must agree on for `job`, as (field, value) pairs."""
    return (("kind", job.kind), ("numel", job.tensor.numel()),
            ("dtype", str(job.tensor.dtype).replace("torch.", "")),
            ("op", getattr(job.op, "name", None)), ("collective", job.spec.describe()),
            ("codec", repr(job.codec)), ("root", job.root))


class Agreement:
    """Verified signatures per process set; used by the communicator's thread only."""

    def __init__(self):
        self._verified = {}        # (set id, ranks) -> {signature: index}

    def check(self, job, channel, sequence):
        """The index of `job`'s signature among the verified ones, at once if it was
        verified before; else after comparing it with every peer's (collective:
        every rank of the set gets here)."""
        mine = signature(job)
        verified = self._verified.setdefault((job.set_id, tuple(job.ranks)), {})
        if mine in verified:
            return verified[mine]
        everyone = self._exchange(job, channel, mine, sequence)
        field, values = _first_difference(everyone)
        if field is not None:
            listed = ", ".join(f"rank {job.ranks[i]} {v}" for i, v in enumerate(values))
            raise ValueError(
                f"collectives.{job.kind} (call #{sequence} on this process set): the ranks "
                f"disagree on {field}: {listed}. Every rank must start the same collectives "
                f"in the same order, with the same size, dtype, op, collective and "
                f"compression")
        verified[mine] = len(verified)
        return verified[mine]

    @staticmethod
    def _exchange(job, channel, mine, sequence):
        import torch

        encoded = json.dumps(dict(mine)).encode()
        if len(encoded) > SIGNATURE_BYTES:
            raise ValueError(f"collective signature too long to check: {encoded[:80]!r}...")
        out = torch.zeros(SIGNATURE_BYTES, dtype=torch.uint8)
        out[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        peers = [i for i in range(job.p) if i != job.me]
        inbox = {i: torch.empty(SIGNATURE_BYTES, dtype=torch.uint8) for i in peers}
        received = {i: channel.recv(inbox[i], i, CHECK_MESSAGE) for i in peers}
        sent = [channel.send(out, i, CHECK_MESSAGE) for i in peers]
        everyone = {job.me: dict(mine)}
        for i, work in received.items():
            try:
                work.wait()
            except RuntimeError as exc:
                raise ValueError(
                    f"rank {job.ranks[job.me]}: collectives.{job.kind} (call #{sequence}, "
                    f"{dict(mine)}) is new to this rank, but rank {job.ranks[i]} did not "
                    f"answer its agreement check: it runs a call verified earlier with other "
                    f"arguments, or it stopped ({exc})") from exc
            everyone[i] = json.loads(bytes(inbox[i].numpy()).rstrip(b"\0"))
        for work in sent:
            work.wait()
        return [everyone[i] for i in range(job.p)]


def _first_difference(everyone):
    for field in FIELDS:
        values = [s.get(field) for s in everyone]
        if len(set(map(str, values))) > 1:
            return field, values
    return None, None
