"""Exact resume inside the frameworks people train with, one line each, in the framework's own idiom:
a Lightning callback (`lightning_resume()`), the Hugging Face Trainer (`trainer_resume(trainer)`) and
Accelerate (`accelerate_resume(accelerator, loader)`).

Each keeps what the framework's checkpoint lacks (where the loop is in its data, the global RNG as the
uninterrupted run next drew from it) inside that checkpoint, through the framework's own save and
resume calls; the framework is imported only by the module that serves it, when used.
"""
