"""An Accelerate loop as its checkpointing docs show it: prepare(), save_state() every --save-every
steps into OUT/step_N, and on --resume load_state() of the newest with skip_first_batches(). The
resume reshuffles the order (the RandomSampler draws its seed from the RNG load_state() restored) and
shifts the dropout masks. With --fixed, the fixes the doctor names: use_seedable_sampler=True,
set_epoch() as each epoch begins, and a generator of the DataLoader's own; the resume is then exact.
With --exact, exactresume's one line instead (and no skip_first_batches): the loader itself continues
where the loop stopped. --workers gives the loader worker processes, --mask a collate function that draws
from the global RNG (as a masking collator does)."""

import argparse
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--fixed", action="store_true", help="apply the fixes the doctor names")
parser.add_argument("--exact", action="store_true", help="exactresume's line: accelerate_resume(accelerator, loader)")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--mask", action="store_true", help="a collate function that draws from the global RNG")
parser.add_argument("--kill-in-save", type=int, help="SIGKILL this process as save_state writes this step's folder")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)
set_seed(0)

accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=args.fixed))
data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
own = {"generator": torch.Generator().manual_seed(1)} if args.fixed else {}


def masking(samples):
    x, y = torch.utils.data.default_collate(samples)
    return x * (torch.rand(x.shape) > 0.2), y


collate = {"collate_fn": masking} if args.mask else {}
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=args.workers, **own, **collate)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
if args.kill_in_save:  # killed after the weights are written, as the optimizer's state is: a folder cut short
    save = torch.save

    def save_or_die(obj, file, *more, **options):
        if f"step_{args.kill_in_save}" in str(file):
            os.kill(os.getpid(), 9)
        return save(obj, file, *more, **options)

    torch.save = save_or_die
if args.exact:
    from exactresume.integrations.accelerate import accelerate_resume

    loader = accelerate_resume(accelerator, loader)

step, batches = 0, []
if args.resume:
    newest = max(os.listdir(args.out), key=lambda name: int(name.removeprefix("step_")))
    accelerator.load_state(os.path.join(args.out, newest))
    step = int(newest.removeprefix("step_"))
epoch, skip = divmod(step, len(loader))
while step < args.steps:
    if args.fixed:
        loader.set_epoch(epoch)
    active = accelerator.skip_first_batches(loader, skip) if skip and not args.exact else loader
    skip = 0
    for x, y in active:
        batches.append(x.clone())
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step % args.save_every == 0:
            accelerator.save_state(os.path.join(args.out, f"step_{step}"))
        if step == args.steps:
            break
    epoch += 1
if args.record:  # under torchrun, each rank's own: RECORD-0.pt, RECORD-1.pt
    record = f"{args.record}-{accelerator.process_index}.pt" if accelerator.num_processes > 1 else args.record
    torch.save({"batches": batches, "weights": accelerator.unwrap_model(model).state_dict()}, record)
