"""A user's own models, as a user writes them (tests/test_any_model.py copies this file into a folder outside the
project): recurrent layers, dropout, token inputs, a language model, regression."""

import torch
import torch.nn.functional as F
from torch import nn


class SeqClassifier(nn.Module):
    """MNIST rows as a sequence of 28 steps of 28 features."""

    def __init__(self, cell="gru", hidden=32):
        super().__init__()
        self.rnn = (nn.GRU if cell == "gru" else nn.LSTM)(28, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def rnn(cell="gru"):
    return SeqClassifier(cell)


def dropout_mlp(p=0.2):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 10))


def dropout_cnn():
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout2d(0.1), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Dropout(0.2), nn.Linear(256, 10))


class TokenTransformer(nn.Module):
    """A transformer encoder on token ids [B, 49] (an image's 7x7 grey levels)."""

    def __init__(self, vocab=8, width=32, length=49):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.enc(self.emb(x) + self.pos).mean(1))


class HashedTokens(TokenTransformer):
    """TokenTransformer over ids of any size, hashed into its 8 entries."""

    def forward(self, x):
        return super().forward(x % 8)


class Bag(nn.Module):
    """An EmbeddingBag over (position, grey level) ids."""

    def __init__(self, vocab=8 * 49, width=32):
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, width, mode="mean")
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.bag(x + 8 * torch.arange(x.shape[-1], device=x.device)))


class TinyLM(nn.Module):
    """A causal transformer over bytes: [B, T] ids -> [B, T, 256] logits."""

    def __init__(self, width=32, layers=1, context=32, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, x):
        t = x.shape[-1]
        return self.head(self.enc(self.emb(x) + self.pos[:t], mask=self.mask[:t, :t]))


def bn_cnn():
    # no bias before BatchNorm: its gradient is zero up to rounding, which AdamW would blow up to steps of lr
    return nn.Sequential(nn.Unflatten(1, (1, 28)), nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(4), nn.Flatten(), nn.Linear(196, 10))


def regressor():
    return nn.Sequential(nn.Flatten(), nn.Linear(392, 32), nn.ReLU(), nn.Linear(32, 1))




class FunctionalDropout(nn.Module):
    """Dropout drawn with F.dropout in forward: no dropout module shows it."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 32), nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(F.dropout(self.fc1(x.flatten(1)).relu(), 0.3, self.training))


def frozen_first_layer():
    m = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
    m[1].weight.requires_grad_(False)  # a user freezes a layer
    return m
