"""PyTorch Lightning as its docs show it: a LightningModule, ModelCheckpoint(every_n_train_steps=...),
and trainer.fit(..., ckpt_path="last") to resume."""

import argparse

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
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

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


pl.seed_everything(0)
data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
model = Regression()
checkpoints = ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.save_every, save_top_k=-1, save_last=True)
trainer = pl.Trainer(
    max_steps=args.steps,
    callbacks=[checkpoints],
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=args.out,
)
trainer.fit(model, loader, ckpt_path="last" if args.resume else None)
if args.record:
    torch.save({"batches": model.batches, "weights": model.state_dict()}, args.record)
