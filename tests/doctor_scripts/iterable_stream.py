"""Bug: a streaming IterableDataset whose examples pass through a small shuffle buffer drawing from a
torch.Generator of its own; the checkpoint holds the model, the optimizer and the step but not the
stream's position, so a resume starts the stream over and replays the first batches. With
--batch-none the DataLoader gets batch_size=None and the dataset yields whole batches itself."""

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
parser.add_argument("--batch-none", action="store_true", help="batch_size=None: the dataset yields batches")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)


class ShuffledStream(IterableDataset):
    """An endless stream of examples (x, y), shuffled through a buffer of `buffer` examples."""

    def __init__(self, buffer: int = 6, seed: int = 1, batch: int | None = None):
        self.buffer, self.seed, self.batch = buffer, seed, batch

    def examples(self):
        index = 0
        while True:
            x = torch.sin(torch.arange(8, dtype=torch.float32) * 0.37 + index)
            yield x, x.sum(0, keepdim=True) * 0.1
            index += 1

    def shuffled(self):
        generator, source = torch.Generator().manual_seed(self.seed), self.examples()
        pool = [next(source) for _ in range(self.buffer)]
        while True:
            at = int(torch.randint(len(pool), (1,), generator=generator))
            yield pool[at]
            pool[at] = next(source)

    def __iter__(self):
        if self.batch is None:
            yield from self.shuffled()
            return
        examples = self.shuffled()
        while True:
            xs, ys = zip(*(next(examples) for _ in range(self.batch)))
            yield torch.stack(xs), torch.stack(ys)


if args.batch_none:
    loader = DataLoader(ShuffledStream(batch=4), batch_size=None)
else:
    loader = DataLoader(ShuffledStream(), batch_size=4)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
path, step, batches = os.path.join(args.out, "resume.pt"), 0, []
if args.resume:
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]

for x, y in loader:  # the stream from its start, resumed or not
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
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)
        if args.record:  # each save's checkpoint kept, for the resume by hand
            shutil.copyfile(path, f"{path}.{step}")
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
