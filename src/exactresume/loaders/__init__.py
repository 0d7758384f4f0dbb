"""The data position of a user's own loader as a part: which epoch, how many batches the loop took,
and the random state its order was drawn from, restored so the next batch is the uninterrupted run's.

Imports only torch, the standard library and `exactresume.errors`: it sits beside `core`, below the
store, so a part from here is saved and loaded like any other.
"""
