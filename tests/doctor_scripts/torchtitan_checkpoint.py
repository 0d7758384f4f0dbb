"""Bug: a torchtitan-style trainer. A CheckpointManager saves torch.distributed.checkpoint (DCP) folders
of Stateful wrappers built on get_model_state_dict / get_optimizer_state_dict, as torchtitan's
components/checkpoint.py does, with the step in a train_state; the LR scheduler is left out of them, so
a resume restarts its warmup. On load DCP asks the optimizer wrapper for its state dict, and an empty
AdamW state is first initialised by one optimizer.step() at lr 0 with zero gradients."""

import argparse
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="ckpt")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--save-every", type=int, default=2)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--record", help="write each step's batch and the final weights here (to check by hand)")
args = parser.parse_args()


class ModelWrapper(Stateful):
    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict):
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=False))


class OptimizersContainer(Stateful):
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state_dict(self, state_dict):
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=options)


class TrainState(Stateful):
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])


class CheckpointManager:
    def __init__(self, folder, states):
        self.folder, self.states = folder, states

    def save(self, step):
        dcp.save(self.states, checkpoint_id=os.path.join(self.folder, f"step-{step}"))

    def load(self):
        steps = [int(name.removeprefix("step-")) for name in os.listdir(self.folder) if name.startswith("step-")]
        dcp.load(self.states, checkpoint_id=os.path.join(self.folder, f"step-{max(steps)}"))


torch.set_num_threads(1)
torch.manual_seed(0)
inputs, targets = torch.randn(64, 8), torch.randn(64, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))  # warmup
train_state = TrainState()
states = {"model": ModelWrapper(model), "optimizer": OptimizersContainer(model, optimizer), "train_state": train_state}
checkpoint = CheckpointManager(args.out, states)
if args.resume:
    checkpoint.load()

batches = []
while train_state.step < args.steps:
    train_state.step += 1
    rows = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(train_state.step))
    batches.append(inputs[rows])
    loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if train_state.step % args.save_every == 0:
        checkpoint.save(train_state.step)
if args.record:
    torch.save({"batches": batches, "weights": model.state_dict()}, args.record)
