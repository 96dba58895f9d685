"""Layer 1, core: what every other layer stands on, and nothing of the toolkit.

The compatibility layer (the one package touching JAX's and Flax's
internals), jaxpr walking and rewriting, formatting of bytes and FLOPs,
glob patterns, the Pareto rule, progress deadlines, example inputs. It
imports no other package of ``remat_toolkit``.
"""
