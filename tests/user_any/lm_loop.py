"""A user's own language-model training loop with ``evomerge.Merger``, launched by torchrun
(tests/test_any_model.py): a causal transformer with dropout and a causal-mask buffer, AdamW, next-byte
cross-entropy over ``[B, T, 256]`` logits, and the loss handed to the Merger for its running score."""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import evomerge
from evomerge import text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mymodels import TinyLM  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM(width=32, context=32, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    parts = text.splits(Path(args.corpus))
    tx, ty = text.windows(parts["train"], 32)
    vx, vy = text.windows(parts["val"], 32)
    g = torch.Generator().manual_seed(rank)
    merger = evomerge.Merger(args.policy, model, opt, seed=0, total_steps=args.steps, timeout=60)
    for _ in range(args.steps):
        model.train()
        bi = torch.randint(len(tx), (32,), generator=g)
        loss = F.cross_entropy(model(tx[bi]).reshape(-1, 256), ty[bi].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        merger.step(loss=loss)
    merger.finish()
    model.eval()
    with torch.no_grad():
        nll = F.cross_entropy(model(vx).reshape(-1, 256), vy.reshape(-1))
    mask = torch.triu(torch.full((32, 32), float("-inf")), 1)
    if rank == 0:
        print(json.dumps({"perplexity": math.exp(float(nll)), "mask_intact": bool(torch.equal(model.mask, mask)),
                          "merges": merger.merges}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
