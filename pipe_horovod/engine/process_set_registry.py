"""Which process sets an engine knows, and what its library calls each.

Every collective resolves its process set here before anything is sent, so a
set that is not registered, or that this rank is not in, is refused the same
way on every engine.
"""
from .process_sets import ProcessSet, check_new_sets, global_process_set

# Point-to-point messages of every process set travel on one gloo group, told apart by their
# tags (collectives/channel.py), which have room for this many sets: a set gets the lowest
# slot no live set it shares two ranks with holds (sets sharing one rank or none never
# exchange a message on the same pair of ranks), so ids of any size are safe.
TAG_SLOTS = 16


class ProcessSetRegistry:
    """Engine's process sets (mixed into Engine); engines provide _add_library_set and
    _remove_library_set."""

    def _register_process_sets(self, process_sets, global_library_set=None):
        """Register the global set and those given to init; engines call this once
        the library is up (Horovod's sets are made by hvd.init itself)."""
        global_process_set.ranks = list(range(self.size()))
        self._process_sets = {0: (global_process_set, global_library_set)}
        self._tag_slots = {0: 0}    # process_set_id -> its slot in message tags
        for ps in check_new_sets(process_sets, self.size(), [global_process_set.ranks]):
            self._adopt(ps)

    def _adopt(self, ps):
        slot = self._free_tag_slot(ps.ranks)
        set_id, library_set = self._add_library_set(ps)
        ps.process_set_id = set_id
        self._process_sets[set_id] = (ps, library_set)
        self._tag_slots[set_id] = slot
        return ps

    def _free_tag_slot(self, ranks):
        """The lowest tag slot no live set sharing two or more of `ranks` holds; sets are
        registered in the same order on every rank, so every rank picks the same."""
        mine = set(ranks)
        taken = {self._tag_slots[i] for i, (ps, _) in self._process_sets.items()
                 if len(mine & set(ps.ranks)) >= 2}
        free = [slot for slot in range(TAG_SLOTS) if slot not in taken]
        if not free:
            raise ValueError(
                f"process set {sorted(mine)} shares two or more ranks with {TAG_SLOTS} "
                f"registered process sets already; the collectives tell at most {TAG_SLOTS} "
                "such sets apart: remove one (remove_process_set) before adding another")
        return free[0]

    def tag_slot(self, set_id):
        """The slot of process set `set_id` in message tags (collectives/channel.py)."""
        return self._tag_slots.get(set_id, set_id % TAG_SLOTS)

    def add_process_set(self, process_set):
        """Register a ProcessSet (or a list of global ranks) on every rank; return it.

        Collective: every rank calls it, in the same order."""
        known = [ps.ranks for ps, _ in self._process_sets.values()]
        (ps,) = check_new_sets([process_set], self.size(), known)
        return self._adopt(ps)

    def remove_process_set(self, process_set):
        """Unregister a set (collective); False if it was not registered or is global."""
        entry = self._process_sets.get(getattr(process_set, "process_set_id", None))
        if entry is None or entry[0] is not process_set or process_set is global_process_set:
            return False
        self._remove_library_set(process_set, entry[1])
        del self._process_sets[process_set.process_set_id]
        del self._tag_slots[process_set.process_set_id]
        process_set.process_set_id = None
        return True

    def resolve_process_set(self, process_set):
        """The registered ProcessSet an operation runs on, checked before anything is sent.

        Why public: code that builds its own collective on the engine's (the two-stage
        quantized allreduce) must refuse the same process sets, the same way.

        Args:
            process_set: a ProcessSet, or None for every rank.

        Returns:
            The ProcessSet (global_process_set for None).

        Raises:
            TypeError: not a pipe_horovod ProcessSet.
            ValueError: not registered with this engine, or this rank is not a member.
        """
        ps = global_process_set if process_set is None else process_set
        if not isinstance(ps, ProcessSet):
            raise TypeError(f"process_set must be a pipe_horovod ProcessSet, got {ps!r}")
        entry = self._process_sets.get(ps.process_set_id)
        if entry is None or entry[0] is not ps:
            raise ValueError(f"{ps} is not registered: pass it to init(process_sets=[...]) or "
                             "add_process_set() first")
        if self.rank() not in ps.ranks:
            raise ValueError(f"rank {self.rank()} is not a member of {ps}")
        return ps

    def process_set_by_id(self, set_id):
        """The registered ProcessSet with Horovod's id `set_id`, or None (the TensorFlow
        identity ops take ids, as Horovod's do)."""
        entry = self._process_sets.get(set_id)
        return None if entry is None else entry[0]

    def _library_set(self, ps):
        """What the library calls process set `ps` (a Horovod ProcessSet, a torch group)."""
        return self._process_sets[ps.process_set_id][1]
