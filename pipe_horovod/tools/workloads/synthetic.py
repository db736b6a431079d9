"""The synthetic models of `pipe-horovod bench` (--model mlp / cnn): sized to a number of
MB of float32 parameters. Here, not in pipe_horovod.tools.bench.models, because
`architectures` tables them too (bench imports workloads, never the reverse).
"""
import math

MLP_IN, MLP_CLASSES = 1024, 1000
CNN_CLASSES = 10
KINDS = ("mlp", "cnn")


def mlp_width(model_bytes, layers, in_features=MLP_IN, classes=MLP_CLASSES):
    """Hidden width H so an MLP of `layers` Linear layers holds ~model_bytes of float32."""
    if layers < 2:
        raise ValueError("an MLP needs at least 2 layers")
    # params = in*H + H + (layers-2)*(H*H + H) + H*classes + classes
    a = layers - 2
    b = in_features + classes + (layers - 1)
    c = classes - model_bytes / 4
    width = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return max(8, int(round(width)))


def build_mlp(model_mb, layers=5):
    """(MLP of `layers` Linear layers holding ~model_mb MB, input shape, classes)."""
    import torch.nn as nn

    width = mlp_width(model_mb * 1e6, layers)
    mods = [nn.Linear(MLP_IN, width), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, MLP_CLASSES))
    return nn.Sequential(*mods), (MLP_IN,), MLP_CLASSES


def build_cnn(model_mb):
    """(small CNN whose classifier head carries ~model_mb MB, input shape, classes)."""
    import torch.nn as nn

    trunk = [nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
             nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
    trunk_params = sum(p.numel() for m in trunk for p in m.parameters())
    feat = 128 * 4 * 4
    # The classifier head carries the rest of the requested size, like VGG's FC layers.
    width = max(16, int((model_mb * 1e6 / 4 - trunk_params - CNN_CLASSES)
                        / (feat + 1 + CNN_CLASSES)))
    head = [nn.Linear(feat, width), nn.ReLU(), nn.Linear(width, CNN_CLASSES)]
    return nn.Sequential(*trunk, *head), (3, 32, 32), CNN_CLASSES


def build_synthetic(kind, model_mb, layers=5):
    """(module, input shape, classes) of the synthetic model `kind` ('mlp' or 'cnn')."""
    if kind == "mlp":
        return build_mlp(model_mb, layers)
    if kind == "cnn":
        return build_cnn(model_mb)
    raise ValueError(f"unknown synthetic model {kind!r}; choose from {', '.join(KINDS)}")
