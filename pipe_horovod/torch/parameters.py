"""Which parameters a pipelined optimizer reduces, under which names.

Names: the model's (`named_parameters`) or `param.0, param.1, ...`, and
`param_group{i}.{j}` for a group added after wrapping without names; they
name tensors in errors, in the bucket plan and in checkpoints, and the
ranks compare them at wrap time.

Ownership: one live wrapper reduces a parameter. Each tracked parameter
gets a post-accumulate-grad hook that hands its gradient to the optimizer
(held weakly, so a dropped optimizer takes its hooks with it); a newer
wrapper of the same parameter applies the older one's gradients in flight
and retires it.

A mixin of _PipelinedOptimizer (torch/optimizer.py). Its state: `_name_of`
(parameter -> name; `_parameter_names` is Horovod's name for it),
`_params` (tracked, in order), `_param_of` (name -> parameter),
`_hook_handles`, `_replaced_by`. It calls on the optimizer:
`_on_grad_ready(param)` (the hooks), `_between_backward_and_step()`,
`flush()`, `_plan(order)`, and reads `_fifo`, `_machine.gather`,
`_hooks_fired`, `_synchronized`; add_param_group resets `_observed` and
`_order_agreed`, so the next step agrees on the ready order again.
"""
import logging
import warnings
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..engine.stall import labelled
from ..pipeline import compare_across_ranks

_log = logging.getLogger("pipe_horovod")
_owner_of = WeakIdKeyDictionary()  # parameter -> weakref to the wrapper reducing it


class _ParameterOwnership:
    """Parameter names, hooks and ownership of _PipelinedOptimizer (module docstring)."""

    def _setup_parameters(self, name_of):
        self._name_of = dict(name_of)
        self._parameter_names = self._name_of    # Horovod's attribute, read by its tests
        self._params, self._param_of, self._hook_handles = [], {}, []
        self._replaced_by = None                 # name of a parameter a newer wrapper took
        # The hooks hold this optimizer weakly; once it is collected, this removes them.
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._track([p for group in self.param_groups for p in group["params"]])

    def _track(self, params):
        """Reduce `params` (those that need a gradient) from the next step on."""
        params = [p for p in params if p.requires_grad]
        _take_over(params, self)
        self._params += params
        self._param_of.update((self._name_of[p], p) for p in params)
        hook = _weak_hook(self)
        self._hook_handles += [p.register_post_accumulate_grad_hook(hook) for p in params]

    def _refuse_if_replaced(self):
        if self._replaced_by is not None:
            raise RuntimeError(
                f"this DistributedOptimizer was replaced: a newer DistributedOptimizer reduces "
                f"its parameter {self._replaced_by!r}. Two live wrappers cannot share a parameter "
                "(each would average its gradient again); step the newer one, or wrap disjoint "
                "sets of parameters")

    def _retire(self, name):
        """A newer wrapper reduces `name` (and maybe more) now: stop reducing anything."""
        _remove_hooks(self._hook_handles)
        self._replaced_by = name

    def add_param_group(self, param_group):
        """Add a group (unfreezing layers, say) whose gradients are reduced like the rest.

        Every rank must add the same group: it is checked across ranks, and
        the buckets are planned again (order agreed at the next step).
        """
        if not hasattr(self, "_fifo"):           # torch's own constructor, before wrapping
            return super().add_param_group(param_group)
        if self._hooks_fired or self._synchronized:
            raise RuntimeError("add_param_group() called between backward and step(); "
                               "call step() first")
        if len(self._fifo):
            raise RuntimeError(
                f"add_param_group() with {len(self._fifo)} gradient(s) in flight: call flush() "
                "first, so every gradient is applied to the parameters it was computed for")
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        added = self.param_groups[-1]["params"]
        for i, p in enumerate(added):
            self._name_of.setdefault(p, f"param_group{index}.{i}")
        # Named for this group, and labelled: a rank that did not add it goes on to its
        # step's reductions, and the stall that follows names the group, not uneven data.
        check = f"{self._machine.prefix}.param_group{index}"
        with labelled(check, f"add_param_group's check of parameter group {index}",
                      f"Parameter group {index} ({len(added)} parameter(s)) was added on some "
                      "ranks only: every rank must call add_param_group with the same group, "
                      "between the same two steps"):
            compare_across_ranks(lambda obj: self._machine.gather(obj, name=check),
                                 _describe([(self._name_of[p], p) for p in added],
                                           [self._name_of[p] for p in added], {}),
                                 what=f"parameter group {index} added after wrapping")
        self._track(added)
        self._observed, self._order_agreed = {}, False
        self._plan([self._name_of[p] for p in reversed(self._params)])


def _weak_hook(opt):
    """A post-accumulate-grad hook that does not keep `opt` alive."""
    ref = weakref.ref(opt)

    def hook(param):
        owner = ref()
        if owner is not None:
            owner._on_grad_ready(param)
    return hook


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()
    handles.clear()


def _take_over(params, new):
    """Make `new` the one wrapper reducing `params`, retiring older live ones.

    A second training phase wraps the same parameters again, often without
    flushing or deleting the first wrapper. Its gradients still in flight
    are applied first (by it, as synchronous Horovod would have done), then
    its hooks are removed and its step() raises.
    """
    older = {}
    for p in params:
        ref = _owner_of.get(p)
        old = ref() if ref is not None else None
        if old is not None and old is not new and old._replaced_by is None:
            older.setdefault(id(old), (old, old._name_of[p]))
    for old, name in older.values():
        if old._between_backward_and_step():
            raise RuntimeError(f"wrapping parameter {name!r} again while the DistributedOptimizer "
                               "already wrapping it is between backward and step(); call its "
                               "step() first")
    for old, name in older.values():
        if len(old._fifo):
            _log.info("pipe_horovod: applying %d gradient(s) of the replaced "
                      "DistributedOptimizer before the new one takes over", len(old._fifo))
        old.flush()
        old._retire(name)
    for p in params:
        _owner_of[p] = weakref.ref(new)


def _describe(named, param_names, options):
    """The parameters (name, shape, dtype, frozen), their order and the options, as the
    ranks compare them."""
    description = {f"parameter {name!r}": f"shape {tuple(p.shape)} {p.dtype}"
                                          f"{'' if p.requires_grad else ' (frozen)'}"
                   for name, p in named}
    description["parameters in the optimizer"] = tuple(param_names)
    description.update({f"option {k}": v for k, v in options.items()})
    return description


def _named(optimizer, named_parameters):
    """{parameter: name} for every named parameter, and the optimizer's in its order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        name_of = {p: f"param.{i}" for i, p in enumerate(params)}
        return name_of, [(name_of[p], p) for p in params]
    named = list(named_parameters)
    for item in named:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError("named_parameters must yield (name, tensor) pairs as "
                            f"model.named_parameters() does, got {item!r:.80}")
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"named_parameters has duplicate names: {dupes}")
    by_param = {}
    for name, p in named:
        if p in by_param:
            raise ValueError(f"one parameter appears twice in named_parameters: "
                             f"{by_param[p]!r} and {name!r}")
        by_param[p] = name
    missing = [i for i, p in enumerate(params) if p not in by_param]
    if missing:
        raise ValueError(f"{len(missing)} parameter(s) of the optimizer (positions {missing[:10]}) "
                         "are missing from named_parameters; pass model.named_parameters() for "
                         "the model the optimizer trains")
    return by_param, [(by_param[p], p) for p in params]


def _group_names(groups, num_groups, name_of):
    """Horovod's `groups`/`num_groups` as a bucket count or lists of parameter names."""
    if num_groups:
        warnings.warn("num_groups is deprecated (as in Horovod); use groups", DeprecationWarning,
                      stacklevel=4)
        groups = num_groups if groups is None else groups
    if groups is None or isinstance(groups, bool):
        if isinstance(groups, bool):
            raise TypeError("groups must be an int or a list of lists of parameters, got a bool")
        return None
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative integer or a list of lists of "
                             f"parameters, got {groups}")
        return groups or None
    if not isinstance(groups, (list, tuple)):
        raise TypeError(f"groups must be an int or a list of lists of parameters, got "
                        f"{type(groups).__name__}")
    seen, result = set(), []
    for group in groups:
        names = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"groups must consist of torch.Tensor, got {type(p).__name__}")
            if p in seen:
                raise ValueError("a parameter can appear only once in groups")
            if p not in name_of:
                raise ValueError("groups holds a tensor that is not one of the optimizer's "
                                 "named parameters")
            seen.add(p)
            names.append(name_of[p])
        result.append(names)
    return result
