"""pipe_horovod.tools.workloads: real architectures' layer tables, and replayed compute."""
import pytest

from pipe_horovod.tools.workloads import architectures

# Published totals: torchvision's resnet50 / vgg16 (weights=None), Hugging Face's
# bert-base-uncased BertModel (with pooler).
PARAMS = {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert-base": 109_482_240}


def _names(table):
    return [(name, shape) for layer in table for name, shape in layer.params]


@pytest.mark.parametrize("model", ["resnet50", "vgg16", "bert-base"])
def test_real_architectures_parameter_counts_and_flops(model):
    table = architectures.layer_table(model, 2)
    assert sum(layer.numel for layer in table) == PARAMS[model]
    # Every parameter exactly once, layers in forward order (nothing lost or doubled).
    module, example = architectures.meta_model(model, 2)
    assert sorted(_names(table)) == sorted((n, tuple(p.shape))
                                           for n, p in module.named_parameters())
    # FLOPs scale with the batch and all of the model's FLOPs land on some layer.
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        module(example)
    assert sum(layer.forward_flops for layer in table) == counter.get_total_flops()
    assert [layer.forward_flops * 3 for layer in table] == \
        [layer.forward_flops * 2 for layer in architectures.layer_table(model, 3)]


def test_gpt2_small_counts_its_tied_head_on_the_last_layer():
    """GPT-2 small's output head is a product with the token embedding in the top module's
    own forward: its FLOPs go to ln_f, the last layer (before whose gradient backward runs
    them), so the table's total is the whole model's. Per token: 12 layers of four
    768x768 projections, two 768x3072 products and the attention's two 128x768 products,
    then the 768x50257 head, 2 FLOPs per multiply-add."""
    batch, seq = 2, 128
    table = architectures.layer_table("gpt2-small", batch)
    assert sum(layer.numel for layer in table) == 124_439_808       # Hugging Face's GPT2LMHeadModel
    per_layer = 2 * (4 * 768 * 768 + 2 * 768 * 3072 + 2 * seq * 768)
    head = 2 * 768 * 50257
    assert sum(layer.forward_flops for layer in table) == batch * seq * (12 * per_layer + head)
    assert table[-1].name == "ln_f" and table[-1].forward_flops == batch * seq * head


def test_resnet50_names_shapes_and_flops_by_hand():
    table = {layer.name: layer for layer in architectures.layer_table("resnet50", 1)}
    names = [layer.name for layer in architectures.layer_table("resnet50", 1)]
    assert names[:4] == ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1"]
    assert names[-1] == "fc"
    # v1.5: the stride sits on the 3x3 convolution; the projection follows conv3/bn3.
    block = [n for n in names if n.startswith("layer2.0.")]
    assert block == ["layer2.0." + n for n in ("conv1", "bn1", "conv2", "bn2", "conv3", "bn3",
                                               "downsample.0", "downsample.1")]
    assert table["layer1.0.conv1"].params == (("layer1.0.conv1.weight", (64, 64, 1, 1)),)
    assert table["layer3.5.conv2"].params == (("layer3.5.conv2.weight", (256, 256, 3, 3)),)
    assert table["layer4.0.downsample.0"].params == \
        (("layer4.0.downsample.0.weight", (2048, 1024, 1, 1)),)
    assert table["fc"].params == (("fc.weight", (1000, 2048)), ("fc.bias", (1000,)))
    # conv1 at 224x224: 112*112 outputs x 64 channels x 3*7*7 multiply-adds, 2 FLOPs each.
    assert table["conv1"].forward_flops == 2 * 112 * 112 * 64 * 3 * 7 * 7
    # layer2.0.conv2 carries the stride: 56 -> 28.
    assert table["layer2.0.conv2"].forward_flops == 2 * 28 * 28 * 128 * 128 * 3 * 3
    assert table["bn1"].forward_flops == 0
    assert table["fc"].forward_flops == 2 * 2048 * 1000


def test_vgg16_and_bert_names_and_shapes():
    vgg = architectures.layer_table("vgg16", 1)
    assert [layer.name for layer in vgg][:3] == ["features.0", "features.2", "features.5"]
    assert vgg[0].params == (("features.0.weight", (64, 3, 3, 3)), ("features.0.bias", (64,)))
    assert vgg[-3].params == (("classifier.0.weight", (4096, 25088)),
                              ("classifier.0.bias", (4096,)))
    assert vgg[-1].params == (("classifier.6.weight", (1000, 4096)),
                              ("classifier.6.bias", (1000,)))
    assert vgg[0].forward_flops == 2 * 224 * 224 * 64 * 3 * 3 * 3
    bert = architectures.layer_table("bert-base", 1, seq_len=128)
    attn = next(layer for layer in bert if layer.name == "encoder.layers.0.self_attn")
    # MultiheadAttention calls out_proj functionally: the layer owns it and its FLOPs
    # (QKV projection, Q K^T and A V over 12 heads of 64, output projection).
    assert attn.params == (
        ("encoder.layers.0.self_attn.in_proj_weight", (2304, 768)),
        ("encoder.layers.0.self_attn.in_proj_bias", (2304,)),
        ("encoder.layers.0.self_attn.out_proj.weight", (768, 768)),
        ("encoder.layers.0.self_attn.out_proj.bias", (768,)))
    s, h = 128, 768
    assert attn.forward_flops == 2 * s * h * 3 * h + 2 * 2 * s * s * h + 2 * s * h * h
    assert [layer.name for layer in bert][:4] == [
        "embeddings.word_embeddings", "embeddings.position_embeddings",
        "embeddings.token_type_embeddings", "embeddings.LayerNorm"]
    assert [layer.name for layer in bert if layer.name.startswith("encoder.layers.11.")] == [
        "encoder.layers.11." + n for n in ("self_attn", "norm1", "linear1", "linear2", "norm2")]
    assert bert[-1].name == "pooler.dense"
    assert architectures.layer_table("bert-base", 1, seq_len=64)[0].params == \
        (("embeddings.word_embeddings.weight", (30522, 768)),)


def test_bench_models_match_the_bench():
    import torch

    from pipe_horovod.tools.bench.models import build_model

    for kind in ("mlp", "cnn"):
        with torch.device("meta"):
            module = build_model(kind, 4.0, 3)[0]
        table = architectures.layer_table(kind, 8, model_mb=4.0, layers=3)
        assert _names(table) == [(n, tuple(p.shape)) for n, p in module.named_parameters()]


def test_equal_to_torchvision_where_it_imports():
    try:
        import torch
        import torchvision.models as tvm
    except Exception as exc:  # noqa: BLE001 - CUDA-only wheels fail at import with many errors
        pytest.skip(f"torchvision does not import here: {exc}")
    for name in ("resnet50", "vgg16"):
        with torch.device("meta"):
            reference = getattr(tvm, name)(weights=None)
        assert _names(architectures.layer_table(name, 1)) == \
            [(n, tuple(p.shape)) for n, p in reference.named_parameters()]


def test_bad_input_says_what_is_wrong():
    with pytest.raises(ValueError, match="unknown model 'resnet18'; choose from resnet50"):
        architectures.layer_table("resnet18", 1)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        architectures.layer_table("vgg16", 0)
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        architectures.layer_table("vgg16", 2.5)
    with pytest.raises(ValueError, match="seq_len must be <= 512"):
        architectures.layer_table("bert-base", 1, seq_len=513)


# ------------------------------------------------------------------- replay

def _hand_table():
    """Three layers of known times (seconds): forward 0.10 / 0.05 / 0.15, backward twice."""
    from pipe_horovod.tools.workloads.architectures import Layer

    table = [Layer("stem", (("stem.weight", (64, 32)), ("stem.bias", (64,))), 10),
             Layer("body.0", (("body.0.weight", (128, 64)),), 5),
             Layer("head", (("head.weight", (10, 128)), ("head.bias", (10,))), 15)]
    return table, replay.layer_times(table, 1e-10)     # 1e-10 TFLOP/s = 100 FLOP/s


replay = pytest.importorskip("pipe_horovod.tools.workloads.replay")


def test_replay_takes_the_configured_times_and_backward_runs_in_reverse():
    import time

    import torch
    import torch.nn.functional as F

    table, times = _hand_table()
    assert [x for t in times for x in (t.forward_s, t.backward_s)] == pytest.approx(
        [0.10, 0.20, 0.05, 0.10, 0.15, 0.30])
    model = replay.ReplayModel(table, times)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == _names(table)
    arrivals = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: arrivals.append((name, time.perf_counter())))
    x, y = torch.zeros(4, 1), torch.zeros(4, dtype=torch.long)
    t0 = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    # Waits never end early (deadlines) and absorb their own overshoot, the forward's last
    # one included (the backward's first wait is shorter by it): no wait ends before its
    # deadline counted from the forward's start. The slack above is for a loaded 2-core
    # machine waking the sleeper late.
    assert 1.0 <= (t1 - t0) / 0.30 < 1.5, (t1 - t0)
    assert 1.0 <= (t2 - t0) / 0.90 and (t2 - t1) / 0.60 < 1.5, (t1 - t0, t2 - t1)
    layer_of = {n: layer.name for layer in table for n, _ in layer.params}
    order = [layer_of[n] for n, _ in arrivals]
    assert order == ["head", "head", "body.0", "stem", "stem"]
    # Each layer's gradients land when its backward ends: 0.30, 0.40, 0.60 s into backward.
    for name, t in arrivals:
        due = {"head": 0.30, "body.0": 0.40, "stem": 0.60}[layer_of[name]]
        assert 1.0 <= (t - t0) / (0.30 + due) and (t - t1) / due < 1.5, (name, t - t1, due)
    for index, layer in enumerate(table):       # real sizes, layer i's value everywhere
        for name, shape in layer.params:
            grad = model.get_parameter(name).grad
            assert grad.shape == shape and torch.all(grad == replay.grad_value(index))


def test_replay_profile_and_bad_input(tmp_path):
    import json

    table, _ = _hand_table()
    path = tmp_path / "profile.json"

    def write(**change):
        data = {"format": "pipe_horovod.replay-profile/1", "model": "mlp", "batch_size": 8,
                "layers": [{"name": "stem", "forward_ms": 1, "backward_ms": 2.5},
                           {"name": "head", "forward_ms": 3, "backward_ms": 4},
                           {"name": "body.0", "forward_ms": 0, "backward_ms": 0.5}]}
        data.update(change)
        path.write_text(json.dumps(data))
        return str(path)

    times = replay.load_profile(write(), table, "mlp", 8)
    assert [t.name for t in times] == ["stem", "body.0", "head"]        # the table's order
    assert [x for t in times for x in (t.forward_s, t.backward_s)] == pytest.approx(
        [0.001, 0.0025, 0.0, 0.0005, 0.003, 0.004])
    cases = [
        ({"format": "x"}, "expected an object with \"format\""),
        ({"batch_size": 16}, "batch_size is 16, this run's is 8"),
        ({"layers": [{"name": "stem", "forward_ms": 1, "backward_ms": 1}]},
         "2 of mlp's 3 layers have no times: body.0, head"),
        ({"layers": [{"name": "tail", "forward_ms": 1, "backward_ms": 1}]},
         "names 'tail', which is not a layer of mlp"),
        ({"layers": [{"name": "stem", "forward_ms": -1, "backward_ms": 1}]},
         "layer 'stem': forward_ms must be a finite number >= 0, got -1"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            replay.load_profile(write(**change), table, "mlp", 8)
    with pytest.raises(ValueError, match="cannot read profile"):
        replay.load_profile(str(tmp_path / "absent.json"), table, "mlp", 8)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        replay.load_profile(str(tmp_path / "broken.json"), table, "mlp", 8)
    with pytest.raises(ValueError, match="device_tflops must be a finite number > 0"):
        replay.layer_times(table, 0)
    with pytest.raises(ValueError, match="exactly one of device_tflops"):
        replay.replay_model("mlp", 8)
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        replay.replay_model("alexnet", 8, device_tflops=1.0)
