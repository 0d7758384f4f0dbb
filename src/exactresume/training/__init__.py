"""Training: the loop and the run's parts (loop, parts), device and precision, one `train` command
(job), preemption, the divergence twin. Imports dist, store, core and the base layer.
"""
