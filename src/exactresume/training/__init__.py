"""Training: the loop and the run's parts (loop, parts), device and precision, one `train` command
(job, job_run), preemption, the divergence twin. Imports parallel, store, core and the base layer.
"""
