"""A script written for a framework this Python does not have: `lightning` (the unified package) where
only `pytorch-lightning` is installed."""

import lightning

print(lightning.__version__)
