"""Everything on disk, and nothing of the model or the loop: the resume file of parts (resume), its seal
(sealed, onepass), the checkpoint folder (folder.CheckpointStore), background saves, fault injection,
sharded DCP folders, weights and safetensors files, what a file or folder holds (contents, listing),
one writer per folder (lock), and the object store (s3/, a room of its own). Imports the base layer only.
"""
