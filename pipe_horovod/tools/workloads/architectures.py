"""Per-layer tables of real models: parameter names and shapes, forward FLOPs.

A "layer" is a module that owns parameters itself (convolution, linear,
norm, embedding, attention's input projection ...), listed in the order the
forward pass first calls it, which is the reverse of the order backward
yields its gradients. Parameters of a sub-module whose forward never runs
belong to the nearest layer that uses them: `nn.MultiheadAttention` hands
`out_proj`'s weight to a functional call instead of calling `out_proj`, so
BERT's `self_attn` layer owns `in_proj_*` and `out_proj.*` and their FLOPs.
FLOPs the top module runs itself, outside every layer (GPT-2's output head, a
product with the tied token embedding), count to the last layer forward calls:
they run after it in forward, so before its gradient is ready in backward.

FLOPs are counted by `torch.utils.flop_counter.FlopCounterMode` on the
`meta` device (nothing allocated) at the given batch size. It counts matrix
products and convolutions (2 per multiply-add) and nothing else, so norms,
embeddings and element-wise work count 0: on an accelerator they are
memory-bound, and a measured profile (`replay.load_profile`) is the way to
give them time.
"""
import dataclasses
import functools
import math

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from pipe_horovod.tools.workloads import networks, synthetic

MODELS = ("resnet50", "vgg16", "bert-base", "gpt2-small", "mlp", "cnn")
DEFAULT_SEQ_LEN = 128


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str                                        # the module's name in the model
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (full parameter name, shape), registered order
    forward_flops: int                               # this layer's own, at the table's batch size

    @property
    def numel(self):
        """Parameter elements (the size of this layer's gradient)."""
        return sum(math.prod(shape) for _, shape in self.params)


def _check_positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")


def check_model(model):
    """Raises ValueError naming the accepted models unless `model` is one of MODELS."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def meta_model(model, batch_size, *, seq_len=DEFAULT_SEQ_LEN, model_mb=50.0, layers=5):
    """(module, one input batch), both on the meta device. model_mb and layers size the
    bench's synthetic mlp / cnn (synthetic.build_synthetic); seq_len is BERT's."""
    check_model(model)
    _check_positive_int(batch_size, "batch_size")
    with torch.device("meta"):
        if model == "resnet50":
            return networks.ResNet50(), torch.empty(batch_size, *networks.IMAGE_SHAPE)
        if model == "vgg16":
            return networks.VGG16(), torch.empty(batch_size, *networks.IMAGE_SHAPE)
        if model in ("bert-base", "gpt2-small"):
            _check_positive_int(seq_len, "seq_len")
            bert = model == "bert-base"
            limit = (networks.BERT_BASE if bert else networks.GPT2_SMALL)["max_positions"]
            if seq_len > limit:
                raise ValueError(f"seq_len must be <= {limit} ({model}'s positions), "
                                 f"got {seq_len}")
            return (networks.BertBase() if bert else networks.GPT2Small(),
                    torch.zeros(batch_size, seq_len, dtype=torch.long))
        module, shape, _ = synthetic.build_synthetic(model, model_mb, layers)
        return module, torch.empty(batch_size, *shape)


def layer_table(model, batch_size, *, seq_len=DEFAULT_SEQ_LEN, model_mb=50.0, layers=5):
    """list[Layer] of `model` (one of MODELS) in forward order, FLOPs at `batch_size`."""
    check_model(model)
    _check_positive_int(batch_size, "batch_size")
    return list(_cached_table(model, batch_size,
                              seq_len if model in ("bert-base", "gpt2-small") else None,
                              float(model_mb), layers))


@functools.lru_cache(maxsize=32)
def _cached_table(model, batch_size, seq_len, model_mb, layers):
    module, example = meta_model(model, batch_size, seq_len=seq_len or DEFAULT_SEQ_LEN,
                                 model_mb=model_mb, layers=layers)
    return tuple(trace_layers(module, example))


def trace_layers(module, example):
    """Run `module(example)` once (meta tensors) and return its layers: see the module doc."""
    called = []
    seen = set()

    def note(mod, _args):
        if id(mod) not in seen:
            seen.add(id(mod))
            called.append(mod)

    hooks = [m.register_forward_pre_hook(note) for m in module.modules()]
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            module.train()(example)
    finally:
        for hook in hooks:
            hook.remove()
    names = {id(m): name for name, m in module.named_modules()}
    layer_names = [names[id(m)] for m in called
                   if next(m.parameters(recurse=False), None) is not None]
    root = type(module).__name__
    counts = counter.get_flop_counts()

    def flops(name):
        return sum(counts.get(f"{root}.{name}" if name else root, {}).values())

    layer_set = set(layer_names)

    def owner(name):
        """The layer that module `name` (or its nearest ancestor) is, or None."""
        while name not in layer_set:
            if not name:
                return None
            name = name.rpartition(".")[0]
        return name

    params = {layer: [] for layer in layer_names}
    for pname, p in module.named_parameters():
        layer = owner(pname.rpartition(".")[0])
        if layer is None:
            raise ValueError(f"parameter {pname!r} of {root} is not used by any layer that "
                             "forward calls")
        params[layer].append((pname, tuple(p.shape)))
    table = []
    for layer in layer_names:
        inner = [other for other in layer_names if other != layer
                 and owner(other.rpartition(".")[0]) == layer]
        own = flops(layer) - sum(flops(other) for other in inner)
        table.append(Layer(layer, tuple(params[layer]), int(own)))
    outside = flops("") - sum(layer.forward_flops for layer in table)
    if table and outside > 0:       # the top module's own work (module doc)
        table[-1] = dataclasses.replace(table[-1], forward_flops=table[-1].forward_flops + outside)
    return table
