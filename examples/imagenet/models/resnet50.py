"""ResNet-50 (He et al., "Deep Residual Learning for Image Recognition").

Bottleneck residual blocks in four stages of 3, 4, 6 and 3 blocks.  The
stride of a down-sampling block sits on its 3x3 convolution (the variant
commonly called ResNet-50 v1.5).  The classifier uses global average pooling
instead of a fixed 7x7 pooling window so that crops smaller than 224 pixels
(e.g. 64 in tests) also work.
"""

import chainer
import chainer.functions as F
import chainer.links as L


def _conv_bn(in_ch, out_ch, ksize, stride=1, pad=0):
    """A convolution without bias followed by batch normalisation."""
    return chainer.Sequential(
        L.Convolution2D(in_ch, out_ch, ksize, stride=stride, pad=pad,
                        nobias=True,
                        initialW=chainer.initializers.HeNormal()),
        L.BatchNormalization(out_ch),
    )


class Bottleneck(chainer.Chain):
    """1x1 reduce, 3x3, 1x1 expand; projection shortcut when shapes change."""

    def __init__(self, in_ch, mid_ch, out_ch, stride=1):
        super().__init__()
        with self.init_scope():
            self.reduce = _conv_bn(in_ch, mid_ch, 1)
            self.spatial = _conv_bn(mid_ch, mid_ch, 3, stride=stride, pad=1)
            self.expand = _conv_bn(mid_ch, out_ch, 1)
            if stride != 1 or in_ch != out_ch:
                self.shortcut = _conv_bn(in_ch, out_ch, 1, stride=stride)
            else:
                self.shortcut = None

    def forward(self, x):
        h = F.relu(self.reduce(x))
        h = F.relu(self.spatial(h))
        h = self.expand(h)
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(h + skip)


class Stage(chainer.ChainList):
    """``n_blocks`` bottlenecks; the first one may down-sample."""

    def __init__(self, n_blocks, in_ch, mid_ch, out_ch, stride):
        super().__init__()
        self.add_link(Bottleneck(in_ch, mid_ch, out_ch, stride))
        for _ in range(n_blocks - 1):
            self.add_link(Bottleneck(out_ch, mid_ch, out_ch))

    def forward(self, x):
        for block in self:
            x = block(x)
        return x


class ResNet50(chainer.Chain):

    insize = 224

    def __init__(self, n_class=1000):
        super().__init__()
        with self.init_scope():
            self.stem = _conv_bn(3, 64, 7, stride=2, pad=3)
            self.stage1 = Stage(3, 64, 64, 256, stride=1)
            self.stage2 = Stage(4, 256, 128, 512, stride=2)
            self.stage3 = Stage(6, 512, 256, 1024, stride=2)
            self.stage4 = Stage(3, 1024, 512, 2048, stride=2)
            self.fc = L.Linear(2048, n_class)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.max_pooling_2d(h, 3, stride=2, pad=1)
        h = self.stage1(h)
        h = self.stage2(h)
        h = self.stage3(h)
        h = self.stage4(h)
        h = F.mean(h, axis=(2, 3))  # global average pooling
        return self.fc(h)
