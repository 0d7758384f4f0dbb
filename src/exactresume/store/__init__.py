"""Everything on disk: the resume file of parts (resume), sealed and atomic writes, the checkpoint
folder (folder.CheckpointStore), background saves, fault injection, sharded DCP folders, weights
and safetensors, inspect and export, the per-step logs. Imports core and the base layer only.
"""
