"""Everything on disk, and nothing of the model or the loop: resume files (resume), their seal (sealed,
onepass), one store of numbered checkpoints (numbered: a place and a layout; newest: which one a load
takes), background saves, faults, sharded DCP folders, weights files, listings, one writer per folder
(lock), and the object store (s3/).
Imports the base layer only.
"""
