"""Tiny random-weight transformers and timm models against the naive-loop reference, in float64.

Every model is built from a config (2 layers, hidden 16-32, vocabulary 100): nothing is downloaded
(``HF_HUB_OFFLINE=1``). Install: ``pip install -e ".[hf]"``; timm with ``--no-deps`` and torchvision as
``.ci/run`` does (see ``_import_timm``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from reference import reference_per_sample  # noqa: E402

import compiled_psg as psg  # noqa: E402

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-7, atol=1e-9)
VOCAB = 100
# Where .ci/run puts torchvision (see _import_timm); PSG_TORCHVISION_DIR overrides it, and "none" says that no
# torchvision exists for this torch (PyPI has none for torch 2.15: another version's extension crashes the process).
TORCHVISION_DIR = Path(os.environ.get("PSG_TORCHVISION_DIR", Path.home() / ".cache/compiled_psg/torchvision"))
NO_TORCHVISION = os.environ.get("PSG_TORCHVISION_DIR") == "none"


def _import_timm():
    """timm imports torchvision at import time. PyPI's only torchvision for torch 2.13 (0.28.0) is a CUDA build
    whose kernels cannot load beside the CPU torch; its Python code imports once the two operator schemas it
    registers fake kernels for exist. .ci/run installs it with ``--no-deps --target`` outside site-packages, so
    no other test sees it; nothing here runs a torchvision operator."""
    try:
        import timm
        return timm
    except ImportError:
        pass
    if NO_TORCHVISION:
        pytest.skip("no torchvision build exists for this torch (PSG_TORCHVISION_DIR=none)")
    if not (TORCHVISION_DIR / "torchvision").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"timm needs torchvision in {TORCHVISION_DIR}: run .ci/run's install lines")
        pytest.skip(f"timm or torchvision not installed (torchvision expected in {TORCHVISION_DIR})")
    if not hasattr(torch.ops.torchvision, "nms"):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBS.append(lib)  # a Library deregisters its schemas when collected
    sys.path.insert(0, str(TORCHVISION_DIR))
    import timm
    return timm


_LIBS: list = []


def _ids(g, *shape):
    return torch.randint(3, VOCAB, shape, generator=g)


def _check(model, loss, args, backend="eager"):
    model.double()
    args = tuple(a.double() if a.is_floating_point() else a for a in args)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = psg.per_sample(model, backend=backend)(loss)(*args)
    ref = reference_per_sample(loss, params, args)
    assert set(got) == set(ref)
    # T5 computes its attention softmax in float32 (scores.float()) even in a float64 model: Inductor fuses those
    # float32 ops differently from eager, so its results agree to float32 precision there
    tol = TOL if backend == "eager" else dict(rtol=1e-4, atol=1e-6)
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, **tol, msg=lambda m, n=name: f"{n}: {m}")
    assert any(r.abs().sum() > 0 for r in ref.values()), "every gradient is zero: the test would prove nothing"


def _causal_lm_cfg(cls, **kw):
    # loss_type set: else transformers logs a warning_once inside the loss, a graph break (see the report)
    return cls(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, loss_type="ForCausalLM", **kw)


def test_gpt2_with_labels():
    T = transformers
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(_causal_lm_cfg(T.GPT2Config, n_layer=2, n_embd=32, n_head=2, n_positions=16,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model.loss_type = "ForCausalLM"  # the model reads it from itself, not only from the config

    def loss(x):  # the mean over the sample's tokens, as labels= computes it
        return model(input_ids=x, labels=x).loss

    _check(model, loss, (_ids(torch.Generator().manual_seed(0), 3, 6),))


def test_llama_with_padding_mask():
    T = transformers
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(_causal_lm_cfg(T.LlamaConfig, num_hidden_layers=2, hidden_size=32,
                                              intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=16))
    g = torch.Generator().manual_seed(0)
    x = _ids(g, 3, 6)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[2, :1] = 0

    def loss(x, mask):
        return model(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss

    _check(model, loss, (x, mask))


def test_bert_classifier_with_padding():
    T = transformers
    torch.manual_seed(0)
    cfg = T.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    model = T.BertForSequenceClassification(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = _ids(g, 3, 6), torch.randint(0, 3, (3,), generator=g)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, -2:] = 0

    def loss(x, mask, y):
        return F.cross_entropy(model(input_ids=x, attention_mask=mask).logits, y, reduction="sum")

    _check(model, loss, (x, mask, y))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_peft_prompt_tuning_gpt2(dtype):
    """PEFT's prompt tuning takes its virtual tokens as ``arange(k).expand(n, -1)[:1]``, embeds them and repeats
    them over the batch: the slice of a value broadcast over the batch was refused as a slice along the batch
    ("it keeps only some samples"). Every row is the same and a batch of one keeps one row too: exact."""
    peft = pytest.importorskip("peft")
    import warnings

    T = transformers
    torch.manual_seed(0)
    base = T.GPT2LMHeadModel(_causal_lm_cfg(T.GPT2Config, n_layer=1, n_embd=16, n_head=2, n_positions=16,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    base.loss_type = "ForCausalLM"
    with warnings.catch_warnings():  # peft calls a method that transformers 5 deprecated
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    x = _ids(torch.Generator().manual_seed(0), 3, 5)

    def loss(x):
        return model(input_ids=x, labels=x).loss

    if dtype == torch.float64:
        _check(model, loss, (x,))
        return
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = psg.per_sample(model, backend="eager")(loss)(x)
    ref = reference_per_sample(loss, params, (x,))
    assert set(got) == set(ref) == {"prompt_encoder.default.embedding.weight"}
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, rtol=1e-4, atol=1e-6)


def test_a_regression_head_whose_built_in_loss_squeezes_the_batch_gets_a_fix_outside_the_library():
    """BERT with ``num_labels=1`` computes ``loss_fct(logits.squeeze(), labels.squeeze())``: refused, once per line,
    and the fix was "name the dimension, squeeze(-1)", inside transformers. It says to compute the loss from the
    logits instead, and that fix is exact."""
    T = transformers
    torch.manual_seed(0)
    cfg = T.BertConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=16, num_labels=1, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    model = T.BertForSequenceClassification(cfg).double()
    g = torch.Generator().manual_seed(0)
    x, y = _ids(g, 3, 6), torch.randn(3, generator=g, dtype=torch.float64)
    with pytest.raises(psg.UnsupportedError, match=r"squeeze\(\) without a dim at .*modeling_bert.py.*Fix: that "
                                                   r"line is in transformers, not in your code.*labels=") as caught:
        psg.per_sample(model, backend="eager")(lambda x, y: model(input_ids=x, labels=y).loss)(x, y)
    assert str(caught.value).count("squeeze() without a dim") == 1
    _check(model, lambda x, y: F.mse_loss(model(input_ids=x).logits.squeeze(-1), y), (x, y))


def _t5(layers=2):
    T = transformers
    torch.manual_seed(0)
    cfg = T.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=32, d_ff=64, d_kv=8, num_heads=2,
                     vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)

    def loss(x, y):  # use_cache=True: the decoder builds its EncoderDecoderCache inside the captured graph
        return model(input_ids=x, labels=y, use_cache=True).loss

    return model, loss, (_ids(g, 3, 6), _ids(g, 3, 4))


@pytest.mark.long  # 60 s of capture on 2 cores: the end-to-end tier
def test_t5_with_cache():
    _check(*_t5())


@pytest.mark.long
@pytest.mark.inductor
def test_t5_with_cache_inductor():
    """Inductor's cat decomposition used to break a captured view here (compiled_psg/_compile/prepare.py). One
    layer each side: the cache's views are built once per layer, and Inductor compiles in minutes at two."""
    _check(*_t5(layers=1), backend="inductor")


def test_vit():
    T = transformers
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    model = T.ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, 16, 16, generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(x, y):
        return F.cross_entropy(model(pixel_values=x).logits, y, reduction="sum")

    _check(model, loss, (x, y))


def test_convnext():
    T = transformers
    torch.manual_seed(0)
    cfg = T.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                           image_size=32, drop_path_rate=0.0)
    model = T.ConvNextForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, 32, 32, generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(x, y):
        return F.cross_entropy(model(pixel_values=x).logits, y, reduction="sum")

    _check(model, loss, (x, y))


def test_timm_resnet_batchnorm_eval():
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3, channels=(8, 8, 16, 16), stem_width=8)
    with torch.no_grad():  # non-trivial running statistics: eval-mode BatchNorm is then a per-channel affine map
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
    model.eval()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, 32, 32, generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(x, y):
        return F.cross_entropy(model(x), y, reduction="sum")

    _check(model, loss, (x, y))


def test_timm_swin_window_attention():
    """Swin folds its windows into the batch (``[B*windows, tokens, C]``) and cuts ``qkv`` with ``unbind(0)``, whose
    backward is a ``stack``: the rewrite lost the rows' layout there and refused without naming the op; its
    relative position bias (``table[index]``) also needs Inductor to write each sample's rows into their own
    storage (``_compile/prepare.py``)."""
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=16,
                              patch_size=2, window_size=4, embed_dim=8, depths=(1, 1), num_heads=(1, 2),
                              drop_path_rate=0.0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, 16, 16, generator=g), torch.randint(0, 3, (3,), generator=g)

    def loss(x, y):
        return F.cross_entropy(model(x), y, reduction="sum")

    _check(model, loss, (x, y))
