"""`exactresume doctor`: a user's own training script run straight, interrupted and resumed under a
tracer, and the first piece of state its resume loses, named. Imports report, train and below; the
tracer it injects into the user's process imports nothing of ours above `store`.
"""
