"""A zoo of small torchvision, timm and open_clip models, each keeping its init in its constructor.

No hub access, no pretrained weights: every model is built in code with small, odd sizes
so that FSDP2 over 4 ranks shards unevenly. Each entry is a module-level builder (picklable
for the multi-rank tests) returning the model as its library builds it, init included:

- torchvision: ResNet (BasicBlock and Bottleneck, ``zero_init_residual``: kaiming_normal fan_out
  convs, BN 1/0, zeroed last BN weight per block), MobileNetV3 (the ``__init__`` module loop),
  VisionTransformer (class token zeros, pos embedding normal 0.02, heads), ConvNeXt
  (``layer_scale * torch.ones``, trunc_normal);
- timm: ViT (``init_weights`` from the constructor: trunc_normal pos embed, normal cls token),
  Swin (relative position index buffers, attention masks), ConvNeXt and RegNet
  (``named_apply``), EfficientNet (``efficientnet_init_weights``), MLP-Mixer;
- open_clip: CLIP with a ViT and with a ModifiedResNet tower (``init_parameters``,
  ``scale * torch.randn`` parameters, ``attn_mask`` built by ``fill_(-inf).triu_(1)``).

:data:`VISION` maps a name to its builder; :data:`DIST` is the subset run on real ranks.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tests._support.vision import define_torchvision_schemas

__all__ = ["VISION", "DIST", "build"]


def _tv():
    define_torchvision_schemas()
    import torchvision

    return torchvision


def _timm():
    define_torchvision_schemas()
    import timm

    return timm


def _open_clip():
    define_torchvision_schemas()
    import open_clip

    return open_clip


def tv_resnet_basic() -> nn.Module:
    _tv()
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=7, zero_init_residual=True)


def tv_resnet_bottleneck() -> nn.Module:
    _tv()
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=7, zero_init_residual=True, width_per_group=8)


def tv_mobilenet_v3() -> nn.Module:
    return _tv().models.mobilenet_v3_small(num_classes=7, width_mult=0.25)


def tv_vit() -> nn.Module:
    _tv()
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=18, mlp_dim=37,
                             num_classes=7)


def tv_convnext() -> nn.Module:
    _tv()
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(12, 22, 1), CNBlockConfig(22, None, 1)], layer_scale=0.5, num_classes=7)


def timm_vit() -> nn.Module:
    return _timm().create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=2, embed_dim=18,
                                num_heads=3, mlp_ratio=2.0, num_classes=7)


def timm_swin() -> nn.Module:
    return _timm().create_model("swin_tiny_patch4_window7_224", img_size=56, patch_size=4, window_size=7,
                                embed_dim=12, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), num_classes=7)


def timm_convnext() -> nn.Module:
    return _timm().create_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 12, 16, 22), num_classes=7,
                                ls_init_value=0.5)


def timm_regnet() -> nn.Module:
    return _timm().create_model("regnetx_002", num_classes=7)


def timm_efficientnet() -> nn.Module:
    return _timm().create_model("tinynet_e", num_classes=7)


def timm_mixer() -> nn.Module:
    _timm()
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(img_size=32, patch_size=8, num_blocks=2, embed_dim=18, num_classes=7)


def clip_vit() -> nn.Module:
    oc = _open_clip()
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    return oc.CLIP(embed_dim=10,
                   vision_cfg=CLIPVisionCfg(layers=2, width=18, head_width=6, patch_size=8, image_size=16),
                   text_cfg=CLIPTextCfg(context_length=9, vocab_size=67, width=18, heads=3, layers=2))


def clip_resnet() -> nn.Module:
    oc = _open_clip()
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    return oc.CLIP(embed_dim=10,
                   vision_cfg=CLIPVisionCfg(layers=(1, 1, 1, 1), width=8, head_width=8, image_size=32),
                   text_cfg=CLIPTextCfg(context_length=9, vocab_size=67, width=18, heads=3, layers=1))


VISION: dict[str, Callable[[], nn.Module]] = {
    "tv_resnet_basic": tv_resnet_basic,
    "tv_resnet_bottleneck": tv_resnet_bottleneck,
    "tv_mobilenet_v3": tv_mobilenet_v3,
    "tv_vit": tv_vit,
    "tv_convnext": tv_convnext,
    "timm_vit": timm_vit,
    "timm_swin": timm_swin,
    "timm_convnext": timm_convnext,
    "timm_regnet": timm_regnet,
    "timm_efficientnet": timm_efficientnet,
    "timm_mixer": timm_mixer,
    "clip_vit": clip_vit,
    "clip_resnet": clip_resnet,
}

#: The models run under FSDP2(4) and FSDP2xTP(2x2) on real ranks (one of each family and kind of init).
DIST: tuple[str, ...] = ("tv_resnet_bottleneck", "tv_vit", "timm_vit", "timm_swin", "timm_efficientnet", "clip_vit")


def build(name: str) -> nn.Module:
    return VISION[name]()
