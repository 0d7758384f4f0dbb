"""A loop that saves its ResumableLoader between epochs, after the `for` has ended, and one that resumes it.

    python between_epochs.py FOLDER straight|resumed

The loader shuffles with a generator of its own, made anew in each process as a script makes it: the
straight run writes FOLDER/straight.pt (the order of epochs 1 and 2) and, after epoch 0, FOLDER/state.pt;
the resumed run loads that state and writes the epochs it reads to FOLDER/resumed.pt.
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from exactresume import ResumableLoader

folder, role = Path(sys.argv[1]), sys.argv[2]
loader = ResumableLoader(
    DataLoader(list(range(8)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
)
batches = []
if role == "resumed":
    loader.load_state_dict(torch.load(folder / "state.pt", weights_only=True))
while loader.epoch < 3:
    for batch in loader:
        batches.append(batch)
    if role == "straight" and loader.epoch == 1:
        torch.save(loader.state_dict(), folder / "state.pt")
        batches = []
torch.save(batches, folder / f"{role}.pt")
