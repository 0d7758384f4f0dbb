"""Checkpoints on an S3-compatible object store (`s3://bucket/prefix`), committed without a rename.

boto3 is behind one door, client.py's ObjectStore (bounded requests, retries, one-line errors). The
rest of the package enters through a small face, and the other modules here are this room's own
(the import contract in pyproject.toml holds it):

    prefix.S3Prefix                              where a CheckpointStore on a prefix keeps its checkpoints
    files.publish_leased / load_committed        one resume file written under the prefix's lease, read back
    kinds.s3_kind / read_s3_resume / local_copy  what a location holds, a verified resume state, a local copy
    sharded.save_sharded_s3 / load_sharded_s3    a DCP folder of every rank's shard
    client.ObjectStore                           listing a prefix (store/listing.py, summaries.py)
"""
