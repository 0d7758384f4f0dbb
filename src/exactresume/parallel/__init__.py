"""Many processes: DDP and FSDP2 replicas, the N-independent mode, the torchrun launcher.

Imports store, core and the base layer."""
