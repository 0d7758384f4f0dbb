"""The `exactresume` commands, one module each, all of one shape; cli.py registers them.

    add_flags(parser)   the command's flags
    run(args) -> int    flags -> a typed job or plan at once -> the work -> the closing summary; exit code

Below `run`'s first lines nothing reads `args`: the job (training.job.TrainJob, lab.LabConfig,
doctor.examine.Plan, ...) is what the layers under the commands take. The pieces several commands
share: output.py (progress, --quiet/--json, the summary), places.py (--data, s3:// locations and
their flags), writer.py (the lock on --out, --wait-lock).
"""
