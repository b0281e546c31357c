"""The models train.py trains (hvdcompress.training.models): their sizes at the reference
width, their outputs, and that train.py's --model offers each Fashion-MNIST classifier."""

from __future__ import annotations

import pytest
import torch

from hvdcompress.training.models import IMAGE_MODELS, MODELS, build_model


@pytest.mark.parametrize(
    "name,params", [("cnn", 206_922), ("mlp10m", 10_020_874), ("vit", 540_170)]
)
def test_reference_sizes(name, params):
    assert sum(p.numel() for p in build_model(name, 16).parameters()) == params


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_image_model_classifies_a_batch_and_has_gradients_everywhere(name):
    torch.manual_seed(0)
    model = MODELS[name](4)
    out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_vit_has_attention_and_mlp_matrices_and_no_buffers():
    model = build_model("vit", 16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["encoder.layers.0.self_attn.in_proj_weight"] == (384, 128)
    assert shapes["encoder.layers.3.linear1.weight"] == (256, 128)
    assert list(model.buffers()) == []  # nothing for ranks to drift apart on
    assert {"vit", "mlp10m", "cnn", "resnet"} <= set(IMAGE_MODELS)
