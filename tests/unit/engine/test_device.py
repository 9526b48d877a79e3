"""prepare_device: a missing CUDA device is a config error; on CUDA, PyTorch's cuDNN
attention (a plan build per new shape, and the engine's shapes change every step) is
turned off; on CPU nothing about attention changes."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import ConfigError
from pdserve.engine.device import prepare_device


@pytest.fixture
def cudnn_attention_on():
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_cuda_turns_cudnn_attention_off(monkeypatch, cudnn_attention_on):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert prepare_device("cuda:0") == torch.device("cuda:0")
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_cpu_leaves_attention_backends_alone(cudnn_attention_on):
    assert prepare_device("cpu") == torch.device("cpu")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cuda_without_a_device_is_a_config_error(monkeypatch, cudnn_attention_on):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        prepare_device("cuda")
    assert torch.backends.cuda.cudnn_sdp_enabled()
