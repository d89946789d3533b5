"""The ImageNet example on a GPU node: our iterator vs Chainer's, start methods, pinned copy."""
