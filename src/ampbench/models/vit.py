"""A vision transformer sized for small images, built from torchvision's ``VisionTransformer``.

It runs exactly the ops that fp16 makes risky (softmax over attention scores,
LayerNorm, large reductions), so the numerics audit has something to say.
"""

from __future__ import annotations

from torch import nn

PATCH = 4  # 32 x 32 images -> 8 x 8 = 64 tokens


def vit_tiny(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    """ViT-Tiny's width (192, 3 heads) at 6 layers with 4-pixel patches: about 2.7 M parameters."""
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=image_size, patch_size=PATCH, num_layers=6, num_heads=3, hidden_dim=192,
                             mlp_dim=768, dropout=0.0, attention_dropout=0.0, num_classes=num_classes)
