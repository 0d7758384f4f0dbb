"""PyTorch Lightning as its docs show it: a LightningModule, ModelCheckpoint(every_n_train_steps=...),
and trainer.fit(..., ckpt_path="last") to resume. With --exact, the one line of exactresume's callback;
--workers gives the loader worker processes (--persistent: kept across epochs), --generator the loader a
torch.Generator of its own."""

import argparse

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--exact", action="store_true", help="add exactresume's callback")
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--persistent", action="store_true", help="persistent_workers=True")
parser.add_argument("--generator", action="store_true", help="the loader's own generator= (seeded)")
parser.add_argument("--validate", action="store_true", help="validate every 4 steps, on a loader without generator=")
parser.add_argument("--devices", type=int, default=1, help="processes: above 1, DDP through Lightning's own launcher")
parser.add_argument("--kill-in-save", type=int, help="SIGKILL this process half-way through writing last.ckpt")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()
torch.set_num_threads(1)


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.batches = []

    def training_step(self, batch, batch_index):
        x, y = batch
        self.batches.append(x.clone())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


pl.seed_everything(0)
data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
options = {"persistent_workers": args.persistent, "num_workers": args.workers}
if args.generator:
    options["generator"] = torch.Generator().manual_seed(1)
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, **options)
model = Regression()
checkpoints = ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every, save_top_k=-1, save_last=True)
if args.kill_in_save:  # half of last.ckpt's bytes written where Lightning writes them, then killed
    import io
    import os

    from lightning_fabric.plugins.io import torch_io

    atomic_save = torch_io._atomic_save

    def save_or_die(checkpoint, path):
        if checkpoint.get("global_step") == args.kill_in_save and "last" in str(path):
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            with open(path, "wb") as file:
                file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            os.kill(os.getpid(), 9)
        atomic_save(checkpoint, path)

    torch_io._atomic_save = save_or_die
exact = []
if args.exact:
    from exactresume.integrations.lightning import lightning_resume

    exact = [lightning_resume()]
trainer = pl.Trainer(
    max_steps=args.steps,
    callbacks=[checkpoints, *exact],
    accelerator="cpu",
    devices=args.devices,
    strategy="ddp" if args.devices > 1 else "auto",
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=args.out,
    **({"val_check_interval": 4, "num_sanity_val_steps": 0} if args.validate else {}),
)
validation = {}
if (
    args.validate
):  # its iterator draws its workers' base seed from the global RNG, as every DataLoader without generator=
    validation = {"val_dataloaders": torch.utils.data.DataLoader(data, batch_size=16)}
trainer.fit(model, loader, ckpt_path="last" if args.resume else None, **validation)
if args.record:  # under DDP, each rank's own: RECORD-0.pt, RECORD-1.pt
    record = f"{args.record}-{trainer.global_rank}.pt" if args.devices > 1 else args.record
    torch.save({"batches": model.batches, "weights": model.state_dict()}, record)
