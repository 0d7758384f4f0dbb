"""Many processes: DDP replicas and the torchrun launcher. Imports store, core and the base layer.
"""
