"""Acceptance on real model code: HF transformers, torchvision/timm/open_clip, torchtitan-style, torchtune, OLMo-core, megatron-core."""
