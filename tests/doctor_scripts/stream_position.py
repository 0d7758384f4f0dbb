"""Bug: a streaming IterableDataset that shuffles its examples a buffer at a time (fill 8, permute them with
its own torch.Generator, yield them) and keeps its position: the checkpoint holds the number of examples
yielded, and a resume skips the source to that point. The buffer's generator is not saved (--save-rng
saves it), so the resumed stream draws the right examples in another order. The resume step falls on a
buffer's boundary: with the generator saved the resume is exact."""

import argparse
import os
import shutil

import torch
from torch.utils.data import DataLoader, IterableDataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--save-rng", action="store_true", help="save the shuffle generator's state too")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)


class BufferedStream(IterableDataset):
    """An endless stream of examples (x, y), shuffled `buffer` examples at a time; `position`: examples yielded."""

    def __init__(self, buffer: int = 8, seed: int = 1):
        self.buffer, self.position = buffer, 0
        self.generator = torch.Generator().manual_seed(seed)

    def example(self, index: int):
        x = torch.sin(torch.arange(8, dtype=torch.float32) * 0.37 + index)
        return x, x.sum(0, keepdim=True) * 0.1

    def __iter__(self):
        start = self.position - self.position % self.buffer
        while True:
            order = torch.randperm(self.buffer, generator=self.generator)
            for at in order.tolist()[self.position - start :]:
                self.position += 1
                yield self.example(start + at)
            start += self.buffer


stream = BufferedStream()
loader = DataLoader(stream, batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, batches = os.path.join(args.out, "resume.pt"), 0, []
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step, stream.position = state["step"], state["position"]
    if args.save_rng:
        stream.generator.set_state(state["generator"])

for x, y in loader:
    if step == args.steps:
        break
    batches.append(x.clone())
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % args.save_every == 0:
        os.makedirs(args.out, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        state["position"] = stream.position
        if args.save_rng:
            state["generator"] = stream.generator.get_state()
        torch.save(state, path)
        if args.record:  # each save's checkpoint kept, for the resume by hand
            shutil.copyfile(path, f"{path}.{step}")
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
