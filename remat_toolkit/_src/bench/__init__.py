"""Layer 8, bench: compiling and timing a real training step per policy.

The workload (model, optimizer, batch), the training step, ``bench`` and
the largest-batch search. Imports the layers below.
"""
