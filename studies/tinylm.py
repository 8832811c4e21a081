"""The model of ``studies/tiny-lm.toml``: a small causal transformer over bytes (vocabulary 256)."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    """Token ids ``[B, T]`` -> next-byte logits ``[B, T, 256]``: an embedding and learned positions, ``layers``
    pre-norm transformer layers under a causal mask (a non-persistent buffer: the module's own, never merged),
    and a linear head."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4, context: int = 64, dropout: float = 0.1,
                 vocab: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        # is_causal=True says what the mask is, so torch does not compare it with a causal one at every call (a
        # data-dependent branch that torch.export, as MLflow's model logging uses it, reports with the whole graph)
        h = self.blocks(self.emb(x) + self.pos[:t], mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def causal_lm(**options) -> CausalLM:
    return CausalLM(**options)
