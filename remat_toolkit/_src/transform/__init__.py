"""Layer 4, transform: applying policies to functions and Flax models.

``remat`` (linen, NNX, plain functions), rules over a model one cannot edit
and the discovery of repeated blocks, groups and scans, and re-policying a
model's own regions. Imports the layers below (core, policies, results).
"""
