"""Model geometry from transformers' config classes: config.json -> `ModelSpec`."""

from kvbridge.models.config import spec_from_hf_config

__all__ = ["spec_from_hf_config"]
