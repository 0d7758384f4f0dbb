"""nanoGPT's loop (karpathy/nanoGPT train.py) in small: get_batch draws random offsets from the global torch
RNG, the next batch is fetched right after the forward (nanoGPT's prefetch), and the checkpoint is written
at the top of an iteration. With --save-rng the checkpoint also holds the torch RNG as it stood before the
prefetch drew the coming batch, and the resume restores it and draws that batch again: exact. Without it
(nanoGPT as it is), the resume draws its batches from a fresh RNG."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--save-rng", action="store_true", help="save the RNG that draws the batches")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(1337)
data = torch.randint(0, 16, (512,))
block_size, batch_size = 8, 4


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.drop, self.head = torch.nn.Embedding(16, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 16)

    def forward(self, idx, targets):
        logits = self.head(self.drop(self.embed(idx)))
        return logits, torch.nn.functional.cross_entropy(logits.view(-1, 16), targets.view(-1))


model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
iter_num, batches = 0, []
if args.resume:
    checkpoint = torch.load(os.path.join(args.out, "ckpt.pt"), weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]
    if args.save_rng:
        torch.set_rng_state(checkpoint["rng_state"])
rng_state = torch.get_rng_state()  # as it stands before get_batch draws the coming batch
X, Y = get_batch()  # fetch the very first batch
while iter_num < args.steps:
    if iter_num > 0 and iter_num % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num}
        torch.save(checkpoint | ({"rng_state": rng_state} if args.save_rng else {}), os.path.join(args.out, "ckpt.pt"))
    batches.append(X.clone())
    logits, loss = model(X, Y)
    rng_state = torch.get_rng_state()
    X, Y = get_batch()  # immediately prefetch the next batch, as nanoGPT does
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
