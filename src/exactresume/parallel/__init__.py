"""Many processes: which replica a rank runs (DDP, FSDP2, the N-independent mode), how a batch splits
over N, and `--nproc N` through PyTorch's elastic agent. Imports store, core and the base layer.
"""
