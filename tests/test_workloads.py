"""pipe_horovod.workloads: real architectures' layer tables, and replayed compute."""
import pytest

from pipe_horovod.workloads import architectures

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

    from pipe_horovod.bench.worker import build_model

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
