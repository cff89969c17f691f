"""CIFAR-sized convolutional models: ResNet-18 with a CIFAR stem (the article's model), and a small CNN."""

from __future__ import annotations

from torch import nn


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with the usual CIFAR stem: a 3x3 stride-1 conv and no max-pool.

    The ImageNet stem (7x7 stride 2, then max-pool) would shrink a 32x32 image
    to 8x8 before the first block.
    """
    from torchvision.models import resnet18  # imported here: the small CNN alone needs no torchvision
    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def small_cnn(num_classes: int = 10) -> nn.Module:
    """Three narrow conv-BN-ReLU blocks and a linear head, for CPU runs.

    Kept narrow on purpose: a CPU has no fp16 convolution-backward kernel, so
    fp16 steps run an emulated path about 70x slower than fp32.
    """
    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                             nn.ReLU(inplace=True))

    return nn.Sequential(
        block(3, 16), nn.MaxPool2d(2),
        block(16, 32), nn.MaxPool2d(2),
        block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, num_classes),
    )
