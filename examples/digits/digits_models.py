"""A small classifier on scikit-learn's bundled digits (8x8 images, 1797 of them, no download):
the loader and the model factory that examples/digits/digits.toml names."""

import numpy as np
import torch
from torch import nn


def load():
    """(train_x, train_y, test_x, test_y): 1500 training and 297 test digits as 64 features in [0, 1].
    evomerge carves the validation split from the training part; the search never sees the test part."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.as_tensor(np.random.default_rng(0).permutation(len(y)))
    test, train = order[:297], order[297:]
    return x[train], y[train], x[test], y[test]


def classifier(hidden: int = 64, batchnorm: bool = True) -> nn.Module:
    """64 -> hidden -> 10, with BatchNorm (running statistics: buffers that merges average)."""
    layers = [nn.Linear(64, hidden, bias=not batchnorm)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(hidden))
    layers += [nn.ReLU(), nn.Linear(hidden, 10)]
    return nn.Sequential(*layers)
