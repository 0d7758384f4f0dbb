"""What a run computes: the MiniMind-compatible model, prepared token data, the batch generators
(random windows, epochs) and comparisons of tensors. No training loop, no checkpoint files; imports
only config and errors.
"""
