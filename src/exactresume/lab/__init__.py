"""The lab of the specification (lab) and the ablation of every resume part (ablate); their training
runs are new processes forked from a warm server (forkserver/). Imports report, training and below.
"""
