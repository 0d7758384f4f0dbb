"""The tracer `exactresume doctor` injects into a user's training process at interpreter start.

It is loaded from its files under a private package name (see `sitecustomize.py`), imports only the
standard library, torch, numpy and xxhash, and does nothing unless `EXACTRESUME_DOCTOR_TRACE` names
the folder its trace goes to. `hooks.Tracer` holds the hooks; `fingerprint` hashes tensors and RNG
states; `live` finds the stateful objects a checkpoint should hold.
"""
