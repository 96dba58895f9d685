"""The JAX and Flax boundary: the only package that touches their internals.

JAX's remat implementations, jaxpr classes and checkpoint-policy objects move
between releases (jax 0.10 keeps ``ClosedJaxpr`` apart from ``Jaxpr`` and
builds policies as classes; 0.11 makes ``ClosedJaxpr`` an alias of
``Jaxpr``; 0.12 returns policies as plain functions again). Everything else
in the package goes through the names this package exports, so a JAX
release changes these modules alone. Public or ``jax.extend`` APIs come
first; what a release can do is detected by probing it, never by comparing
version numbers. ``tests/test_compat.py`` pins each behaviour relied on.

One module per concern:

- ``jaxpr_types``: the jaxpr classes and primitives; evaluating and pruning
  a jaxpr; what a tracer says of its value.
- ``flags``: the ``jax_remat3`` and ``jax_custom_vjp3`` switches; the
  toolkit's part of JAX's jit cache keys.
- ``probes``: what this release does, found by tracing or compiling tiny
  programs.
- ``policies``: JAX's checkpoint-policy constructors, markers, and whether a
  policy keeps its meaning under remat3.
- ``equations``: remat regions, scans and name stacks.
- ``kernels``: ``custom_vjp`` and Pallas kernels; the jaxprs an equation runs.
- ``flax_hooks``: Flax's private hooks, for linen and NNX.
- ``sharding``: sharding in a program's types; exported programs.
"""

from remat_toolkit._src.core.compat.equations import bind_remat
from remat_toolkit._src.core.compat.equations import checkpoint_name_of
from remat_toolkit._src.core.compat.equations import drop_leading_scopes
from remat_toolkit._src.core.compat.equations import eval_context
from remat_toolkit._src.core.compat.equations import is_remat
from remat_toolkit._src.core.compat.equations import is_scan
from remat_toolkit._src.core.compat.equations import is_scope
from remat_toolkit._src.core.compat.equations import kernel_mark_of
from remat_toolkit._src.core.compat.equations import leading_scopes as leading_scopes
from remat_toolkit._src.core.compat.equations import mark_kernel
from remat_toolkit._src.core.compat.equations import module_scopes
from remat_toolkit._src.core.compat.equations import nest_scopes
from remat_toolkit._src.core.compat.equations import prefix_scopes
from remat_toolkit._src.core.compat.equations import remat_body_consts as remat_body_consts
from remat_toolkit._src.core.compat.equations import remat_body_of
from remat_toolkit._src.core.compat.equations import remat_policy_of
from remat_toolkit._src.core.compat.equations import scan_num_carry
from remat_toolkit._src.core.compat.equations import scan_num_consts as scan_num_consts
from remat_toolkit._src.core.compat.equations import user_source
from remat_toolkit._src.core.compat.equations import with_remat
from remat_toolkit._src.core.compat.flags import custom_vjp3_enabled
from remat_toolkit._src.core.compat.flags import fresh_trace_key
from remat_toolkit._src.core.compat.flags import has_custom_vjp3_flag
from remat_toolkit._src.core.compat.flags import has_remat3_flag
from remat_toolkit._src.core.compat.flags import has_trace_key_context
from remat_toolkit._src.core.compat.flags import is_cudnn_unavailable
from remat_toolkit._src.core.compat.flags import is_reduce_precision_refusal
from remat_toolkit._src.core.compat.flags import remat3
from remat_toolkit._src.core.compat.flags import remat3_enabled
from remat_toolkit._src.core.compat.flags import trace_key
from remat_toolkit._src.core.compat.flags import trace_key_part
from remat_toolkit._src.core.compat.flax_hooks import flax_lift_pack
from remat_toolkit._src.core.compat.flax_hooks import is_linen_remat as is_linen_remat
from remat_toolkit._src.core.compat.flax_hooks import is_nnx_node_states as is_nnx_node_states
from remat_toolkit._src.core.compat.flax_hooks import linen_decorator_lift_transform
from remat_toolkit._src.core.compat.flax_hooks import linen_lift_transform
from remat_toolkit._src.core.compat.flax_hooks import linen_scope_path
from remat_toolkit._src.core.compat.flax_hooks import nnx_merge_inputs as nnx_merge_inputs
from remat_toolkit._src.core.compat.flax_hooks import nnx_split_inputs as nnx_split_inputs
from remat_toolkit._src.core.compat.jaxpr_types import ClosedJaxpr
from remat_toolkit._src.core.compat.jaxpr_types import DropVar
from remat_toolkit._src.core.compat.jaxpr_types import Jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import JaxprEqn
from remat_toolkit._src.core.compat.jaxpr_types import Literal
from remat_toolkit._src.core.compat.jaxpr_types import Var
from remat_toolkit._src.core.compat.jaxpr_types import abstractify as abstractify
from remat_toolkit._src.core.compat.jaxpr_types import close_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import dce_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import enclosing_remat
from remat_toolkit._src.core.compat.jaxpr_types import eval_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import inner_jaxpr as inner_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import is_computed
from remat_toolkit._src.core.compat.jaxpr_types import is_jaxpr_value as is_jaxpr_value
from remat_toolkit._src.core.compat.jaxpr_types import is_nested_jit_argument
from remat_toolkit._src.core.compat.jaxpr_types import is_tracer as is_tracer
from remat_toolkit._src.core.compat.jaxpr_types import jaxpr_consts
from remat_toolkit._src.core.compat.jaxpr_types import name_p
from remat_toolkit._src.core.compat.jaxpr_types import remat_p
from remat_toolkit._src.core.compat.jaxpr_types import rewrap_jaxpr as rewrap_jaxpr
from remat_toolkit._src.core.compat.jaxpr_types import saved_residuals
from remat_toolkit._src.core.compat.kernels import CustomVJPRules
from remat_toolkit._src.core.compat.kernels import call_body
from remat_toolkit._src.core.compat.kernels import custom_vjp_forward
from remat_toolkit._src.core.compat.kernels import custom_vjp_rules
from remat_toolkit._src.core.compat.kernels import has_python_transpose
from remat_toolkit._src.core.compat.kernels import hidden_jaxprs
from remat_toolkit._src.core.compat.kernels import is_custom_vjp_call
from remat_toolkit._src.core.compat.kernels import is_leaf as is_leaf
from remat_toolkit._src.core.compat.kernels import is_pallas_call
from remat_toolkit._src.core.compat.kernels import kernel_name
from remat_toolkit._src.core.compat.kernels import note_leaf as note_leaf
from remat_toolkit._src.core.compat.kernels import pallas_cost_flops
from remat_toolkit._src.core.compat.kernels import pallas_grid_size
from remat_toolkit._src.core.compat.kernels import rule_fingerprint
from remat_toolkit._src.core.compat.policies import _policy_classes as _policy_classes
from remat_toolkit._src.core.compat.policies import jax_policy
from remat_toolkit._src.core.compat.policies import jax_policy_offloads
from remat_toolkit._src.core.compat.policies import offloading_refusal
from remat_toolkit._src.core.compat.policies import offloading_unsupported
from remat_toolkit._src.core.compat.policies import policy_marker
from remat_toolkit._src.core.compat.policies import remat3_honours
from remat_toolkit._src.core.compat.probes import _cast_layers as _cast_layers
from remat_toolkit._src.core.compat.probes import _scanned_matmul as _scanned_matmul
from remat_toolkit._src.core.compat.probes import custom_vjp_alignment
from remat_toolkit._src.core.compat.probes import (
    dots_saveable_keeps_convs as dots_saveable_keeps_convs,
)
from remat_toolkit._src.core.compat.probes import remat3_calls_policies
from remat_toolkit._src.core.compat.probes import remat3_everything_keeps_unnamed
from remat_toolkit._src.core.compat.probes import remat3_offloads
from remat_toolkit._src.core.compat.probes import remat3_sees_into_custom_vjp
from remat_toolkit._src.core.compat.probes import (
    xla_converts_loop_inputs_whole as xla_converts_loop_inputs_whole,
)
from remat_toolkit._src.core.compat.probes import (
    xla_merges_parameter_casts as xla_merges_parameter_casts,
)
from remat_toolkit._src.core.compat.sharding import ShardingTypeError
from remat_toolkit._src.core.compat.sharding import aval_sharding
from remat_toolkit._src.core.compat.sharding import pickle_exported
from remat_toolkit._src.core.compat.sharding import unpickle_exported

# The names imported "as" themselves are exported too, outside __all__: the
# helpers a few modules and tests reach as ``compat.<name>``.
__all__ = [
    "Jaxpr", "ClosedJaxpr", "JaxprEqn", "Var", "Literal", "DropVar", "name_p",
    "remat_p", "close_jaxpr", "jaxpr_consts", "eval_jaxpr", "dce_jaxpr",
    "saved_residuals", "is_computed", "is_nested_jit_argument",
    "enclosing_remat", "remat3_enabled", "remat3",
    "has_remat3_flag", "has_custom_vjp3_flag", "custom_vjp3_enabled",
    "is_cudnn_unavailable", "is_reduce_precision_refusal",
    "remat3_calls_policies", "remat3_offloads", "remat3_honours",
    "remat3_everything_keeps_unnamed", "offloading_unsupported",
    "offloading_refusal", "jax_policy_offloads", "jax_policy", "policy_marker",
    "checkpoint_name_of", "is_remat", "is_scan", "scan_num_carry", "remat_policy_of",
    "remat_body_of", "with_remat", "bind_remat", "is_scope", "module_scopes",
    "drop_leading_scopes", "nest_scopes", "prefix_scopes", "eval_context",
    "user_source", "flax_lift_pack", "linen_scope_path", "linen_lift_transform",
    "linen_decorator_lift_transform", "call_body", "hidden_jaxprs", "kernel_name",
    "is_custom_vjp_call", "is_pallas_call", "pallas_grid_size", "pallas_cost_flops",
    "custom_vjp_forward", "has_python_transpose", "mark_kernel", "kernel_mark_of",
    "rule_fingerprint",
    "remat3_sees_into_custom_vjp", "custom_vjp_alignment", "ShardingTypeError",
    "aval_sharding", "pickle_exported", "unpickle_exported", "has_trace_key_context",
    "trace_key", "trace_key_part", "fresh_trace_key", "CustomVJPRules",
    "custom_vjp_rules",
]
