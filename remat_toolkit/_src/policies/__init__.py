"""Layer 2, policies: what a policy is, and everything decided about one.

The :class:`~remat_toolkit._src.policies.policy.Policy` value and its
lowering to JAX's constructors, checkpoint names (``tag``, kernel residuals),
region keys, policy files, the catalogue, the one resolver (the ambient
policy included), the trace-time decision of a region, region inputs, and
the wording of every finding. Imports only :mod:`~remat_toolkit._src.core`.
"""
