"""What a run computes: the MiniMind-compatible model, prepared token data, the batch generators
(random windows, epochs), comparisons of tensors and the per-step logs a run writes (steplog). No
training loop, no checkpoint files; imports only the base layer.
"""
