"""ResNet-50, VGG-16 and a BERT-base encoder, as modules to build on the `meta` device.

torchvision is the natural source of the first two, but no torchvision wheel
imports beside this project's torch 2.13.0 CPU build (PyPI's 0.28.0, the one
made for 2.13.0, links CUDA libraries: 'operator torchvision::nms does not
exist'). So they are written here from the papers -- ResNet-50 as in He et
al. 2015, table 1, with the stride on the 3x3 convolution of each bottleneck
("v1.5", what torchvision and MLPerf train); VGG-16 as configuration D of
Simonyan & Zisserman 2014 -- with the module names torchvision gives them, so
parameter names (`layer1.0.conv1.weight`, `features.0.weight`,
`classifier.6.bias`) and counts (25,557,032 and 138,357,544) are the ones
users see in torchvision; tests check both. Initialisation is left to torch's
defaults: these modules only describe shapes and FLOPs.

The BERT-base encoder (Devlin et al. 2018: vocabulary 30522, hidden 768, 12
layers of 12 heads, intermediate 3072, 512 positions, 2 token types) is
torch's own `nn.TransformerEncoderLayer` behind BERT's embeddings, with
BERT's pooler; its 109,482,240 parameters equal Hugging Face's BertModel's.
"""
import torch
import torch.nn as nn

RESNET50_BLOCKS = (3, 4, 6, 3)
BOTTLENECK_EXPANSION = 4
# VGG configuration D: output channels of each 3x3 convolution, "M" a 2x2 max-pool.
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                512, 512, 512, "M", 512, 512, 512, "M")
IMAGENET_CLASSES = 1000
IMAGE_SHAPE = (3, 224, 224)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4; projection shortcut
    when the shape changes."""

    def __init__(self, in_channels, width, stride):
        super().__init__()
        out_channels = width * BOTTLENECK_EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet50(nn.Module):
    def __init__(self, classes=IMAGENET_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = 64
        for index, (blocks, width) in enumerate(zip(RESNET50_BLOCKS, (64, 128, 256, 512))):
            stride = 1 if index == 0 else 2
            stage = []
            for block in range(blocks):
                stage.append(Bottleneck(channels, width, stride if block == 0 else 1))
                channels = width * BOTTLENECK_EXPANSION
            setattr(self, f"layer{index + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG16(nn.Module):
    def __init__(self, classes=IMAGENET_CLASSES):
        super().__init__()
        layers, channels = [], 3
        for item in VGG16_CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2, stride=2))
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1), nn.ReLU(inplace=True)]
                channels = item
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


BERT_BASE = {"vocab": 30522, "hidden": 768, "layers": 12, "heads": 12,
             "intermediate": 3072, "max_positions": 512, "token_types": 2}


class BertEmbeddings(nn.Module):
    def __init__(self, vocab, hidden, max_positions, token_types):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(token_types, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, token_ids):
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        x = (self.word_embeddings(token_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(torch.zeros_like(token_ids)))
        return self.dropout(self.LayerNorm(x))


class BertPooler(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.activation = nn.Tanh()

    def forward(self, x):
        return self.activation(self.dense(x[:, 0]))


class BertBase(nn.Module):
    """Embeddings, 12 post-norm GELU encoder layers, pooler (the [CLS] vector)."""

    def __init__(self, vocab=BERT_BASE["vocab"], hidden=BERT_BASE["hidden"],
                 layers=BERT_BASE["layers"], heads=BERT_BASE["heads"],
                 intermediate=BERT_BASE["intermediate"],
                 max_positions=BERT_BASE["max_positions"],
                 token_types=BERT_BASE["token_types"]):
        super().__init__()
        self.max_positions = max_positions
        self.embeddings = BertEmbeddings(vocab, hidden, max_positions, token_types)
        layer = nn.TransformerEncoderLayer(hidden, heads, intermediate, dropout=0.1,
                                           activation="gelu", layer_norm_eps=1e-12,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = BertPooler(hidden)

    def forward(self, token_ids):
        return self.pooler(self.encoder(self.embeddings(token_ids)))


GPT2_SMALL = {"vocab": 50257, "hidden": 768, "layers": 12, "heads": 12,
              "intermediate": 3072, "max_positions": 1024}


class GPT2Small(nn.Module):
    """GPT-2 small's shapes (Radford et al. 2019): token and position embeddings, 12
    pre-norm GELU decoder layers under a causal mask, a final norm, and the output head
    tied to the token embedding, so its 124,439,808 parameters equal Hugging Face's
    GPT2LMHeadModel's. The GPU kit measures memory on it: the size users fine-tune."""

    def __init__(self, vocab=GPT2_SMALL["vocab"], hidden=GPT2_SMALL["hidden"],
                 layers=GPT2_SMALL["layers"], heads=GPT2_SMALL["heads"],
                 intermediate=GPT2_SMALL["intermediate"],
                 max_positions=GPT2_SMALL["max_positions"]):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_positions, hidden)
        layer = nn.TransformerEncoderLayer(hidden, heads, intermediate, dropout=0.0,
                                           activation="gelu", layer_norm_eps=1e-5,
                                           batch_first=True, norm_first=True)
        self.h = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, token_ids):
        length = token_ids.shape[1]
        positions = torch.arange(length, device=token_ids.device)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=token_ids.device)
        x = self.h(self.wte(token_ids) + self.wpe(positions), mask=mask, is_causal=True)
        return self.ln_f(x) @ self.wte.weight.T
