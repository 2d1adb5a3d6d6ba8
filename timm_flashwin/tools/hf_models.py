"""transformers models for ``verify`` and ``bench`` (``timm-flashwin verify --hf CONFIG``):
the model a config describes, called on images like a timm model.

CONFIG is, in the order tried:

- a model type, as transformers names it: ``swin``, ``swinv2``, ``donut-swin``,
  ``maskformer-swin``, ``swin2sr``, ``beit``, ``data2vec-vision``, ``sam``, ``sam_hq``,
  ``vitdet`` (its default config: swin-tiny's for ``swin``, SAM ViT-B's for ``sam``);
- a config class name: ``SwinConfig``, ``Swinv2Config``, ... (its defaults);
- a config.json, or a directory holding one (a saved model), or a Hub name already in the
  local cache (``AutoConfig.from_pretrained``: nothing is downloaded when offline).

Any of them may end in ``:ModelClass`` to pick the head, e.g.
``swin2sr:Swin2SRForImageSuperResolution``; the default is the config's image classifier
where transformers has one, else its base model. Weights are random (drawn from ``seed``)
unless ``pretrained``: then ``from_pretrained`` reads them from the directory or cache.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .usage import UsageError

#: ``verify_model`` / ``benchmark_model`` names that start with this are transformers CONFIGs
HF_PREFIX = "hf:"


class HfImageModel(nn.Module):
    """A transformers model called as ``model(images)`` -> its first output tensor (logits,
    last_hidden_state, reconstruction), flattened to (B, -1) so that ``bench``'s
    cross-entropy takes it. ``pretrained_cfg["input_size"]`` is (3, H, W) from the config,
    as timm models carry it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        config = model.config
        size = getattr(config, "image_size", getattr(getattr(config, "vision_config", None), "image_size", 224))
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        self.pretrained_cfg = {"input_size": (getattr(config, "num_channels", 3), height, width)}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images)[0].flatten(1)


def load_config(spec: str):
    """The config ``spec`` names (the module's docstring), its model class name or None."""
    import transformers

    spec, _, class_name = spec.partition(":")
    if spec in transformers.CONFIG_MAPPING:
        return transformers.AutoConfig.for_model(spec), class_name or None
    config_class = getattr(transformers, spec, None)
    if isinstance(config_class, type) and issubclass(config_class, transformers.PretrainedConfig):
        return config_class(), class_name or None
    try:
        # local files only: a config is read, never fetched (and an unknown name fails at once)
        return transformers.AutoConfig.from_pretrained(spec, local_files_only=True), class_name or None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hf {spec}: neither a transformers model type, a config class, a config.json nor a "
                         f"model in the local cache (offline?): {str(exc).splitlines()[0][:200]}") from None


def model_class(config, class_name: Optional[str]) -> type:
    """The class ``class_name`` names, else the config's image classifier, else its base model."""
    import transformers

    if class_name:
        cls = getattr(transformers, class_name, None)
        if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
            raise UsageError(f"--hf ...:{class_name}: not a transformers model class")
        return cls
    for auto in (transformers.AutoModelForImageClassification, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise UsageError(f"--hf: transformers has no model for {type(config).__name__}")


def _set_image_size(config, size) -> None:
    """The input size, on the config and on the sub-configs that keep one of their own (SAM's
    and SAM-HQ's vision encoder and prompt encoder, whose image embedding follows it)."""
    config.image_size = size
    for name in ("vision_config", "prompt_encoder_config"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "image_size"):
            sub.image_size = size
            if hasattr(sub, "image_embedding_size") and isinstance(size, int):
                sub.image_embedding_size = size // sub.patch_size


def build_hf_model(spec: str, *, img_size=None, pretrained: bool = False, train: bool = False, seed: int = 0,
                   overrides: Optional[Dict] = None) -> HfImageModel:
    """The model ``spec`` describes (the module's docstring), at ``img_size`` (N or (H, W))
    where given, without drop path when ``train`` (the compared runs must draw alike);
    ``overrides``: config attributes set before building (a smaller model: depths, ...)."""
    import transformers

    config, class_name = load_config(spec)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise UsageError(f"--hf {spec}: {type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)
    if img_size is not None:
        _set_image_size(config, img_size if isinstance(img_size, int) else list(img_size))
    if train and hasattr(config, "drop_path_rate"):
        config.drop_path_rate = 0.0
    cls = model_class(config, class_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if not pretrained:
            return HfImageModel(cls(config))
        if spec.partition(":")[0] in transformers.CONFIG_MAPPING or hasattr(transformers, spec.partition(":")[0]):
            raise UsageError(f"--hf {spec} --pretrained: weights come from a saved model's directory or the cache")
        return HfImageModel(cls.from_pretrained(spec.partition(":")[0], config=config, local_files_only=True))

