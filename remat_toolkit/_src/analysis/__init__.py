"""Layer 6, analysis: what a policy keeps, where, and what it costs.

A loss traced once and read under any policy, the residual accounting
(bytes equal to JAX's ``saved_residuals``), per-device shares, the findings
about a result, ``analyze``/``compare``, the memory breakdown and
``verify``. Imports the layers below, the built-in models included.
"""
