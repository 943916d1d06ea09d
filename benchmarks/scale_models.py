"""The models people train, as data: ``SCALE_MODELS[name]`` builds one at full size (GPU) or scaled down to
10M to 30M parameters (CPU), from a config with random weights: nothing is downloaded.

| name | full size (GPU) | scaled (CPU) |
|---|---|---|
| ``gpt2`` | GPT-2 small, 124M, T = 1024 | 4 layers of width 256, T = 128 |
| ``llama_lora`` | Llama-3.2-1B-shaped, 1.2B, LoRA r = 16 on attention and MLP, bfloat16, T = 512 | GPU only |
| ``vit`` | ViT-B/16 at 224 x 224, 86M | 6 layers of width 384 |
| ``resnet50_gn`` | ResNet-50 with GroupNorm(32), 224 x 224, 25.5M | width 48 at 96 x 96 |
| ``bert_last`` | BERT-base classification, T = 128, last layer, pooler, classifier trained | 4 layers, width 256 |

``bert_last`` trains what Opacus' own BERT benchmark trains.

Each entry gives ``(model, make_batch, criterion)`` like ``benchmarks.models``: ``model(x)`` returns logits (the
Hugging Face models are wrapped in ``LogitsOf``) and frozen parameters have ``requires_grad=False``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .models import TokenCrossEntropy, images, next_tokens, token_labels

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class LogitsOf(nn.Module):
    """A Hugging Face model as ``x -> logits`` (float32 logits, so the loss is computed in float32 whatever the
    model's dtype, as the recipes for bfloat16 training do)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits.float()


# -- ResNet-50 with GroupNorm ----------------------------------------------------------------------


def _gn(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        c_out = width * self.expansion
        self.conv1, self.gn1 = nn.Conv2d(c_in, width, 1, bias=False), _gn(width)
        self.conv2, self.gn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), _gn(width)
        self.conv3, self.gn3 = nn.Conv2d(width, c_out, 1, bias=False), _gn(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _gn(c_out))

    def forward(self, x):
        out = torch.relu(self.gn1(self.conv1(x)))
        out = torch.relu(self.gn2(self.conv2(out)))
        out = self.gn3(self.conv3(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet50GN(nn.Module):
    """torchvision's ResNet-50 layout (stages of 3, 4, 6, 3 bottlenecks) with GroupNorm(32) for BatchNorm, the
    usual DP replacement; ``width`` 64 is the published network."""

    def __init__(self, width: int = 64, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), _gn(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, c_in = [], width
        for stage, count in enumerate((3, 4, 6, 3)):
            w = width * 2 ** stage
            for i in range(count):
                blocks.append(Bottleneck(c_in, w, 2 if (i == 0 and stage > 0) else 1))
                c_in = w * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


# -- builders --------------------------------------------------------------------------------------


def _gpt2(layers: int, width: int, heads: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=max(seq, 1024))
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    return LogitsOf(model), next_tokens(config.vocab_size, seq), TokenCrossEntropy()


def _llama_lora(layers: int, width: int, intermediate: int, heads: int, kv_heads: int, vocab: int, seq: int,
                rank: int):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=width, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         tie_word_embeddings=True, max_position_embeddings=max(seq, 2048))
    base = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora).to(torch.bfloat16)
    return LogitsOf(model), next_tokens(vocab, seq), TokenCrossEntropy()


def _vit(layers: int, width: int, heads: int, image: int, classes: int = 1000):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                       intermediate_size=4 * width, image_size=image, patch_size=16, num_labels=classes)
    model = ViTForImageClassification._from_config(config, attn_implementation="sdpa")
    return LogitsOf(model), images(3, image, classes), nn.CrossEntropyLoss()


def _resnet50_gn(width: int, image: int, classes: int = 1000):
    return ResNet50GN(width, classes), images(3, image, classes), nn.CrossEntropyLoss()


def _bert_last(layers: int, width: int, heads: int, seq: int, classes: int = 2):
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * width, num_labels=classes)
    model = BertForSequenceClassification._from_config(config, attn_implementation="sdpa")
    for p in model.parameters():
        p.requires_grad_(False)
    for part in (model.bert.encoder.layer[-1], model.bert.pooler, model.classifier):
        for p in part.parameters():
            p.requires_grad_(True)
    return LogitsOf(model), token_labels(config.vocab_size, seq, classes), nn.CrossEntropyLoss()


@dataclass(frozen=True)
class ScaleSpec:
    label: str
    build: Callable[..., tuple[nn.Module, Callable, nn.Module]]
    gpu: dict
    gpu_batch: int
    cpu: dict | None = None  # None: GPU only
    cpu_batch: int = 8
    tiny: dict = field(default_factory=dict)  # overrides for --tiny: checks the harness, gives no figures

    def config(self, scaled: bool, tiny: bool = False) -> dict:
        base = self.gpu if not scaled or self.cpu is None else self.cpu
        return {**base, **self.tiny} if tiny else base


SCALE_MODELS: dict[str, ScaleSpec] = {
    "gpt2": ScaleSpec("GPT-2 small (transformers)", _gpt2, dict(layers=12, width=768, heads=12, seq=1024), 8,
                      dict(layers=4, width=256, heads=4, seq=128), 8,
                      tiny=dict(layers=1, width=32, heads=2, seq=16)),
    "llama_lora": ScaleSpec(
        "Llama-3.2-1B-shaped, LoRA r=16, bfloat16", _llama_lora,
        dict(layers=16, width=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, seq=512, rank=16), 8,
        tiny=dict(layers=1, width=64, intermediate=128, heads=4, kv_heads=2, vocab=256, seq=16, rank=4)),
    "vit": ScaleSpec("ViT-B/16 (transformers), 224x224", _vit, dict(layers=12, width=768, heads=12, image=224), 64,
                     dict(layers=6, width=384, heads=6, image=224), 8,
                     tiny=dict(layers=1, width=32, heads=2, image=32)),
    "resnet50_gn": ScaleSpec("ResNet-50, GroupNorm", _resnet50_gn, dict(width=64, image=224), 64,
                             dict(width=64, image=64), 16, tiny=dict(width=32, image=32)),
    "bert_last": ScaleSpec("BERT-base classification, last layer trained", _bert_last,
                           dict(layers=12, width=768, heads=12, seq=128), 32,
                           dict(layers=4, width=256, heads=4, seq=128), 32,
                           tiny=dict(layers=2, width=32, heads=2, seq=16)),
}


def build_scale_model(name: str, scaled: bool, device: torch.device, tiny: bool = False):
    """``(model, make_batch, criterion)`` on ``device``: the full config, the scaled one, or with ``tiny`` the
    scaled one shrunk to seconds of compiling (a GPU-only model then runs on the CPU too)."""
    spec = SCALE_MODELS[name]
    if scaled and spec.cpu is None and not tiny:
        raise ValueError(f"{name} runs on a GPU only")
    torch.manual_seed(0)
    model, make_batch, criterion = spec.build(**spec.config(scaled, tiny))
    return model.to(device), make_batch, criterion.to(device)
