"""A small ResNet-style CNN with BatchNorm on Fashion-MNIST: the loader and the factory that
examples/fashion-resnet/fashion_resnet.toml names.

The loader reads Fashion-MNIST with evomerge's own file lookup ($EVOMERGE_DATA_DIR, the user
cache, /usr/share/datasets/fashion-mnist; downloaded with checksums when missing)."""

import torch
from torch import nn


def load():
    """(train_x, train_y, test_x, test_y): images as [N, 1, 28, 28] float, normalised."""
    from evomerge import data

    spec = data.get_spec("fashion-mnist")
    where = data.locate(spec)

    def read(split, part):
        name = spec.files[split, part]
        path = where / name if (where / name).is_file() else where / name.removesuffix(".gz")
        return torch.from_numpy(data.read_idx(path).copy())

    def norm(x):
        return ((x.float() / 255.0 - spec.mean) / spec.std).unsqueeze(1)

    return (norm(read("train", "images")), read("train", "labels").long(),
            norm(read("test", "images")), read("test", "labels").long())


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.skip(x))


def small_resnet(width: int = 8, n_classes: int = 10) -> nn.Module:
    """Stem, two residual blocks (28 -> 14 -> 7), global average pooling, a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        Block(width, width, 2), Block(width, 2 * width, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, n_classes),
    )
