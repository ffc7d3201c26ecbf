"""The weights' digest in a KV identity: equal for the same files anywhere, different when any
tensor differs (a partial fine-tune included), refused in one line for a damaged file."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from kvbridge.errors import ConfigError
from kvbridge.models.weights_digest import SAMPLE, weights_digest


def _model(path, seed: int, tweak: str | None = None):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.w": torch.randn(64, 128, generator=g) for i in range(4)}  # 32 KiB each
    if tweak is not None:  # one value deep inside one tensor, away from both sampled ends
        tensors[tweak] = tensors[tweak].clone()
        tensors[tweak][40, 5] += 1.0
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_same_files_same_digest_other_weights_other_digest(tmp_path):
    a = _model(tmp_path / "a", 1)
    copy = tmp_path / "elsewhere" / "a"
    shutil.copytree(a, copy)
    assert weights_digest(a) == weights_digest(copy)  # the path is not the identity
    assert weights_digest(_model(tmp_path / "b", 2)) != weights_digest(a)  # same shapes, other values
    # A tensor's last bytes differ (a partial fine-tune changes whole tensors; each is sampled at both ends).
    c = _model(tmp_path / "c", 1)
    data = bytearray((c / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (c / "model.safetensors").write_bytes(bytes(data))
    assert weights_digest(c) != weights_digest(a)
    assert 64 * 128 * 4 > 2 * SAMPLE  # the tweak below is between the sampled ends: not seen, by design
    assert weights_digest(_model(tmp_path / "d", 1, tweak="layers.2.w")) == weights_digest(a)


def test_a_config_only_directory_and_damaged_files(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text("{}")
    assert len(weights_digest(tmp_path / "cfg")) == 32
    bad = _model(tmp_path / "bad", 1)
    (bad / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="safetensors header of 1099511627776 bytes"):
        weights_digest(bad)
