"""A loop that saves its ResumableLoader between epochs, after the `for` has ended, and one that resumes it.

    python between_epochs.py FOLDER straight|resumed [persistent]

The loader shuffles with a generator of its own, made anew in each process as a script makes it: the
straight run writes FOLDER/straight.pt (the order of epochs 1 and 2) and, after epoch 0, FOLDER/state.pt;
the resumed run loads that state and writes the epochs it reads to FOLDER/resumed.pt. With `persistent`,
it shuffles from the global RNG (saved beside the loader) through two persistent workers: the straight
run's iterator, kept across epochs, draws no new base seed for epoch 1, where the resumed run's first does.
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from exactresume import ResumableLoader

folder, role = Path(sys.argv[1]), sys.argv[2]
persistent = sys.argv[3:] == ["persistent"]
torch.manual_seed(0)
shuffled = (
    {"num_workers": 2, "persistent_workers": True} if persistent else {"generator": torch.Generator().manual_seed(0)}
)
loader = ResumableLoader(DataLoader(list(range(8)), batch_size=4, shuffle=True, **shuffled))
batches = []
if role == "resumed":
    saved = torch.load(folder / "state.pt", weights_only=True)
    loader.load_state_dict(saved["loader"])
    torch.set_rng_state(saved["rng"])
while loader.epoch < 3:
    for batch in loader:
        batches.append(batch)
    if role == "straight" and loader.epoch == 1:
        torch.save({"loader": loader.state_dict(), "rng": torch.get_rng_state()}, folder / "state.pt")
        batches = []
torch.save(batches, folder / f"{role}.pt")
