"""A small convolutional network that trains in minutes on a CPU.

Three 3x3 convolution blocks (convolution, batch normalisation, ReLU), two of
them followed by 2x2 max pooling, then global average pooling and a linear
classifier.  It is meant for smoke tests and for measuring the input
pipeline, not for accuracy on ImageNet.
"""

import chainer
import chainer.functions as F
import chainer.links as L


class TinyNet(chainer.Chain):

    def __init__(self, n_class=1000, width=32):
        super().__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, width, 3, pad=1, initialW=w,
                                         nobias=True)
            self.bn1 = L.BatchNormalization(width)
            self.conv2 = L.Convolution2D(width, width * 2, 3, pad=1,
                                         initialW=w, nobias=True)
            self.bn2 = L.BatchNormalization(width * 2)
            self.conv3 = L.Convolution2D(width * 2, width * 4, 3, pad=1,
                                         initialW=w, nobias=True)
            self.bn3 = L.BatchNormalization(width * 4)
            self.fc = L.Linear(width * 4, n_class)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pooling_2d(F.relu(self.bn2(self.conv2(h))), 2)
        h = F.relu(self.bn3(self.conv3(h)))
        h = F.mean(h, axis=(2, 3))  # global average pooling
        return self.fc(h)
