"""The lab of the specification (lab), the ablation of every resume part (ablate) and the warm
fork server that starts the lab's training processes. Imports report, training and below.
"""
