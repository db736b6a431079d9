"""One collective's traffic: accumulator ranges encoded, sent, received, decoded.

Three wire buffers, each the size of the whole message on the wire, so no
region is written while a send from it may still be in flight:
`send` holds this rank's encoded partial sums (each block is encoded at
most once per collective), `recv` the partial sums it receives (decoded
before that region is received into again), `final` the encoded final
values, which are forwarded byte for byte and decoded by every rank,
the one that encoded them included. So every rank decodes the same bytes
and the result is identical everywhere, whatever the codec.

With error feedback, `residual` receives what this rank's encodes lost,
in the units of the sum: the next reduction of the same bucket adds it back.
"""

from ..compression import divide_


class Exchange:
    def __init__(self, channel, codec, layout, work, buffers, residual=None, factor=1.0):
        self.channel = channel
        self.codec = codec
        self.layout = layout
        self.work = work                  # the accumulator: float32 or float64
        self.send_wire, self.recv_wire, self.final_wire = buffers.wires
        self.scratch = buffers.scratch
        self.residual = residual
        self.factor = factor              # sum -> result: 1/p for Average, times postscale
        self._sends = []

    # --- ranges -------------------------------------------------------------
    def _parts(self, b0, b1):
        """(start, stop, wire start, wire stop) of each unit the codec encodes alone."""
        layout = self.layout
        if self.codec.elementwise:
            units = [(b0, b1)]
        else:
            units = [(b, b + 1) for b in range(b0, b1)]
        for u0, u1 in units:
            start, stop = layout.span(u0, u1)
            if stop > start:
                yield (start, stop, *layout.wire_span(u0, u1))

    def empty(self, b0, b1):
        start, stop = self.layout.span(b0, b1)
        return stop == start

    # --- codec --------------------------------------------------------------
    def encode(self, wire, b0, b1, feedback=True):
        residual = self.residual if feedback else None
        for start, stop, w0, w1 in self._parts(b0, b1):
            self.codec.encode(self.work[start:stop], wire[w0:w1], self.scratch[start:stop],
                              None if residual is None else residual[start:stop])

    def add(self, wire, b0, b1):
        for start, stop, w0, w1 in self._parts(b0, b1):
            self.codec.decode_add(wire[w0:w1], self.work[start:stop])

    def take(self, wire, b0, b1):
        for start, stop, w0, w1 in self._parts(b0, b1):
            self.codec.decode_into(wire[w0:w1], self.work[start:stop])

    def scale(self, b0, b1):
        """Turn the sum into the result (Average, postscale) where it is complete."""
        if self.factor != 1.0:
            start, stop = self.layout.span(b0, b1)
            self.work[start:stop].mul_(self.factor)

    def finalize(self, b0, b1):
        """Scale a completed range and encode it into the final wire.

        Scaling first keeps a 16-bit wire from overflowing on a sum whose
        average fits. The encode's loss is in result units: divided back by
        the factor, it is the loss of the sum that feedback must restore."""
        self.scale(b0, b1)
        self.encode(self.final_wire, b0, b1)
        if self.residual is not None and self.factor not in (0.0, 1.0):
            start, stop = self.layout.span(b0, b1)
            divide_(self.residual[start:stop], self.factor)

    # --- messages -----------------------------------------------------------
    def send(self, wire, b0, b1, peer, message):
        if self.empty(b0, b1):
            return
        w0, w1 = self.layout.wire_span(b0, b1)
        self._sends.append(self.channel.send(wire[w0:w1], peer, message))

    def recv(self, wire, b0, b1, peer, message):
        """Post a receive; None for an empty range (the sender skips it too)."""
        if self.empty(b0, b1):
            return None
        w0, w1 = self.layout.wire_span(b0, b1)
        return self.channel.recv(wire[w0:w1], peer, message)

    def send_partial(self, b0, b1, peer, message):
        """Encode this rank's partial sum of a range and send it."""
        if not self.empty(b0, b1):
            self.encode(self.send_wire, b0, b1)
            self.send(self.send_wire, b0, b1, peer, message)

    def finish(self):
        """Wait for this rank's sends: their buffers are reused by the next collective."""
        for work in self._sends:
            work.wait()
        self._sends = []


def wait(work):
    if work is not None:
        work.wait()

