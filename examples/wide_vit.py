"""A wide vision transformer for small images: the kind of model where fp8 training can pay off.

    model:
      factory: examples.wide_vit:build

Width 4096 and MLP width 16384, 4 layers, 4-pixel patches (about 800 M parameters): at batch 256 on 32 x 32
images each MLP GEMM is 16,640 x 4,096 x 16,384, the size where fp8's faster tensor cores outweigh its scaling and
casts (torchao's own H100 benchmark: fp8 0.80x bf16 at 1024x2048x1024, 1.39x at 4096x8192x16384). A GPU model:
`ampbench roofline --gpu "H100 SXM" ` with it as model.factory shows what each precision could give.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.vision_transformer import VisionTransformer


def build(num_classes: int = 10, image_size: int = 32) -> nn.Module:
    return VisionTransformer(image_size=image_size, patch_size=4, num_layers=4, num_heads=16, hidden_dim=4096,
                             mlp_dim=16384, dropout=0.0, attention_dropout=0.0, num_classes=num_classes)
