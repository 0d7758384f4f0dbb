"""The tracer `exactresume doctor` injects into a user's training process at interpreter start.

It is loaded from its files under a private package name (see `sitecustomize.py`), imports only the
standard library, torch, numpy and xxhash, and does nothing unless `EXACTRESUME_DOCTOR_TRACE` names
the folder its trace goes to. `hooks.Tracer` holds the hooks; `fingerprint` hashes tensors and RNG
states; `live` finds the stateful objects a checkpoint should hold; `order` the sampler that draws a
DataLoader's order; `files` every path a process writes. The exit codes below are here, without
torch, for the doctor, which reads them before it imports torch.
"""

CUT = 86  # the process was cut after LIMIT steps, as asked
CRASH = 87  # the process was ended as a crash would end it, right after its checkpoint
