"""Network definitions for the ImageNet example.

Every model maps a batch of images ``(N, 3, H, W)`` to unnormalised class
scores ``(N, n_class)``; the training script wraps it in
:class:`chainer.links.Classifier`.  All models end with global average
pooling, so any crop size that survives their down-sampling works.
"""

from models.resnet50 import ResNet50  # NOQA
from models.tiny import TinyNet  # NOQA

ARCHS = {
    'resnet50': ResNet50,
    'tiny': TinyNet,
}
