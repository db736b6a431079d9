"""Point-to-point messages of one collective, on a torch.distributed gloo group.

Peers are named by their index in the collective's rank list; a message by
a small id that both sides compute from the algorithm's schedule. The tag
puts the collective's sequence number, call signature and process set above
that id, so two collectives (or two phases of one) never match each other's
messages, even when a rank runs ahead to the next step's collective.

The process set is there as its tag slot (engine/process_set_registry.py), not its id:
the tag had room for 4 bits of the id, so sets 1 and 17 (on the same ranks) sent
messages the other could receive. Slots are unique among the live sets that share a
pair of ranks, whatever their ids.
"""
from ..engine import current, is_initialized
from ..engine.process_set_registry import TAG_SLOTS

MESSAGE_BITS = 17
SET_BITS = TAG_SLOTS.bit_length() - 1
# The verified call signature's index (collectives/agreement.py): ranks that run two
# different verified signatures at once send on different tags, so their messages
# never meet (a wait that times out) instead of meeting with the wrong size (gloo aborts).
SIGNATURE_BITS = 4
SEQUENCE_BITS = 31 - MESSAGE_BITS - SET_BITS - SIGNATURE_BITS


def tag_base(sequence, set_id, signature=0, slot=None):
    """Tags stay below 2**31 (gloo's tags are C ints): sequence numbers wrap, which is
    safe because a collective 2**6 launches back finished long ago on every rank (a
    rank cannot finish a collective before its peers have started it). `slot`: the set's
    tag slot; None: the engine's for `set_id` (no engine, as in a test's stand-in: the
    id's low bits)."""
    if slot is None:
        slot = current().tag_slot(set_id) if is_initialized() else set_id % (1 << SET_BITS)
    if not 0 <= slot < (1 << SET_BITS):
        raise AssertionError(f"tag slot {slot} of process set {set_id} out of range")
    seq = sequence % (1 << SEQUENCE_BITS)
    high = (((seq << SIGNATURE_BITS) | (signature % (1 << SIGNATURE_BITS))) << SET_BITS
            | slot)
    return high << MESSAGE_BITS


class Channel:
    def __init__(self, dist, group, ranks, base):
        self.dist = dist
        self.group = group
        self.ranks = ranks          # global ranks, by index
        self.base = base

    def _tag(self, message):
        if not 0 <= message < (1 << MESSAGE_BITS):
            raise AssertionError(f"message id {message} out of range")
        return self.base | message

    def send(self, tensor, peer, message):
        return self.dist.isend(tensor, dst=self.ranks[peer], group=self.group,
                               tag=self._tag(message))

    def recv(self, tensor, peer, message):
        return self.dist.irecv(tensor, src=self.ranks[peer], group=self.group,
                               tag=self._tag(message))
