"""Process sets: subsets of ranks that run collectives among themselves.

Horovod's `ProcessSet`, engine-neutral. Users build one from a list of
global ranks before or after `init`; an engine then registers it (at
`init(process_sets=[...])` or with `add_process_set`), which gives it an
id, and collectives take it as `process_set=`. What the library needs (a
Horovod process-set id, a torch.distributed group) stays inside the engine,
so the object a script holds is the same on every engine.

Roots and ranks passed to collectives stay *global* ranks, as in Horovod;
`ProcessSet.rank()` is the position inside the set (what orders an
allgather's result).
"""


_rank_of_this_process = None      # engine/__init__.py gives its rank(): the running engine's


def follow_rank(rank):
    """How to learn this process's global rank: `rank()`, asked at each use (the engine
    running then). The engine package calls it when it loads, so this module, which the
    package imports, never imports the package back."""
    global _rank_of_this_process
    _rank_of_this_process = rank


def _current_rank():
    return _rank_of_this_process()


class ProcessSet:
    """A sorted list of global ranks; `process_set_id` is None until registered."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise ValueError(
                f"ProcessSet takes a list of global ranks, got {ranks_or_comm!r} "
                "(MPI communicators are not supported by pipe_horovod)")
        ranks = list(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks!r}")
        if any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct and non-negative, got {ranks!r}")
        self.ranks = sorted(ranks)

    def size(self):
        """Number of ranks in the set, or None while it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's position in the set, or None while it is not registered."""
        if self.process_set_id is None:
            return None
        me = _current_rank()
        if me not in self.ranks:
            raise ValueError(f"rank {me} is not part of {self}")
        return self.ranks.index(me)

    def included(self):
        """Whether this process belongs to the set (None before ranks are known)."""
        return None if self.ranks is None else _current_rank() in self.ranks

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


# Every rank; its ranks are filled in when an engine starts.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def check_new_sets(process_sets, size, registered=()):
    """Validate sets about to be registered; return them as a list of ProcessSet.

    Checked here, before the library sees them: Horovod answers an
    out-of-range or duplicate set with "initialization failed" or a crash.
    `size` may be None when the world size is not known yet.
    """
    if process_sets is None:
        return []
    sets = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
    seen = {tuple(ranks) for ranks in registered}
    for ps in sets:
        if ps is global_process_set:
            raise ValueError("global_process_set is always registered; do not pass it")
        if not ps.ranks:
            raise ValueError(f"{ps} has no ranks")
        if size is not None and ps.ranks[-1] >= size:
            raise ValueError(f"{ps} names rank {ps.ranks[-1]}, but there are {size} rank(s)")
        if size is not None and ps.ranks == list(range(size)):
            raise ValueError(f"{ps} duplicates the global process set")
        if tuple(ps.ranks) in seen:
            raise ValueError(f"duplicate process set {ps}")
        seen.add(tuple(ps.ranks))
    return sets
