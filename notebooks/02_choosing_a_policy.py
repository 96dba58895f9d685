# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Choosing a policy: compare them all, read the trade-off
#
# Every policy is a point on a trade-off: activation memory kept for the
# backward pass against compute spent recomputing the rest. `rt.compare`
# measures every policy of the catalogue on one model, tracing the model once,
# and `comparison.plot()` draws the memory-vs-recompute chart.
#
# The model is the toolkit's built-in GPT-2 small (12 layers, sequence 1024,
# batch 8, bfloat16 activations), each block in a remat region that reads the
# ambient policy. It is analysed from *abstract shapes*: the parameters come from
# `jax.eval_shape` and the batch is `jax.ShapeDtypeStruct`s, so nothing is
# allocated and no device is needed.

# %%
import math

import jax

import remat_toolkit as rt
from remat_toolkit import models

config = models.get_config("gpt2-small")
loss_fn, (params, batch) = models.build_loss(config)

num_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
print(f"{config.name}: {config.num_layers} layers, d_model {config.d_model}, "
      f"seq {config.seq_len}, batch {config.batch_size}, "
      f"activations {config.dtype}; {num_params / 1e6:.1f}M parameters")
print("a parameter leaf:", jax.tree_util.tree_leaves(params)[0])
print("the batch:", batch)

# %% [markdown]
# ## Every built-in policy on one model
#
# `rt.compare(loss_fn, params, batch)` analyses every policy in
# `rt.list_policies()` (pass `policies=[...]` for a subset). In Jupyter the
# comparison renders as a table, Pareto-optimal rows in bold; `print(comparison)`
# gives the same table as text.

# %%
import warnings

# A comparison's findings are raised as warnings and kept in
# `comparison.warnings`; this notebook reads them there, once, below.
with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  comparison = rt.compare(loss_fn, params, batch)
comparison

# %% [markdown]
# ## What the comparison warns about
#
# `comparison.warnings` holds what the analysis found that changes a choice.
# On this model one finding is expected: the naive attention core multiplies
# two activations (queries by keys, probabilities by values), so a policy that
# keeps every matmul output keeps the seq x seq logits of every head, which is
# what a flash-attention kernel exists not to store.

# %%
for finding in comparison.warnings:
  print(finding)

# %% [markdown]
# ## How to read a row
#
# - **activations**: bytes the backward pass keeps *on device* under this
#   policy, for the whole step (all layers, the whole batch). Parameters and
#   inputs are not counted: they are in memory whatever the policy.
# - **% of save-everything**: the same, relative to keeping every residual (no
#   remat).
# - **offloaded**: bytes the policy moves to host memory instead of keeping them
#   on device. They cost no device memory, but each crosses the host link twice
#   (out in the forward pass, back in the backward pass), and that time is not in
#   the recompute column.
# - **recompute**: matrix-multiplication FLOPs the backward pass redoes, as a
#   percentage of the FLOPs of a training step without remat. Element-wise work
#   (norms, activations, softmax) is recomputed too but not counted.
# - **residuals**: how many activation arrays are kept.
# - **largest**: the biggest residual groups this policy keeps that *not every
#   policy keeps*: what this policy spends its memory on, beyond what all of
#   them must keep (such as each region's input).
# - **pareto**: no other policy is at least as good on device bytes, recompute
#   and offloaded bytes, and better on one. A policy off the front is never the
#   right choice on these three measures.
#
# The numbers below come from the same comparison as data.

# %%
df = comparison.to_dataframe()
df["activation_GiB"] = df.activation_bytes / 2**30
df["offloaded_GiB"] = df.offloaded_bytes / 2**30
df[["policy", "activation_GiB", "offloaded_GiB", "recompute_percent",
    "num_residuals", "largest", "pareto"]].round(2)

# %%
base = comparison.baseline
print(f"forward pass: {base.forward_flops / 1e12:.2f} TFLOP of matmuls; "
      f"no-remat step: {base.baseline_step_flops / 1e12:.2f} TFLOP; "
      f"{comparison.regions} remat regions")
print("Pareto-optimal:", ", ".join(n for n, ok in comparison.pareto().items() if ok))
print("not Pareto-optimal:",
      ", ".join(n for n, ok in comparison.pareto().items() if not ok))

# Policies whose different names land on the same point: the extra names one
# of them keeps are not needed by the backward pass of this model.
points = df.groupby(["activation_bytes", "offloaded_bytes", "recompute_flops"])
for _, group in points:
  if len(group) > 1:
    print("same bytes and recompute:", ", ".join(group.policy))

# %% [markdown]
# ## The Pareto chart
#
# Offloading policies spend a third resource (host transfers) that a
# two-dimensional chart cannot show, so the chart below compares the policies
# that keep everything on device. Each point is a policy: to the right means
# more memory kept, up means more recompute. Red points are Pareto-optimal and
# the red line joins them; for a grey point, some red point is no further right
# and no higher. The horizontal axis turns logarithmic when memory spans more
# than 30x, so that policies far apart stay readable (`comparison.plot()`
# returns the matplotlib axes, to adjust like any other).

# %%
on_device = [n for n in rt.list_policies() if not rt.get_policy(n).offloads]
with warnings.catch_warnings():
  warnings.simplefilter("ignore")  # the same findings as above
  device_comparison = rt.compare(loss_fn, params, batch, policies=on_device)
ax = device_comparison.plot()

# %% [markdown]
# ## From the chart to a choice
#
# Read the front from the right: the first red point left of your memory is the
# policy with the least recompute you can afford. The cell below does that for
# an example budget, 40% more than `boundary-only` keeps; notebook
# `04_fitting_a_budget` does it properly, counting parameters and optimizer
# state too and planning a policy for the budget rather than picking a built-in.
#
# Residuals outside every remat region, such as those of the loss's softmax over
# the vocabulary, are kept whatever the policy; `by_module` lists them as
# `(top level)`, beside the bytes each block keeps.

# %%
budget = 1.4 * comparison.reports["boundary-only"].activation_bytes
fits = df[(df.activation_bytes <= budget) & (df.offloaded_bytes == 0)]
# On a tie, a preset of ours rather than the same one under MaxText's or Praxis's name.
fits = fits.assign(field=fits.policy.str.startswith(("maxtext-", "praxis-")))
choice = fits.sort_values(["recompute_flops", "activation_bytes", "field"]).iloc[0]
print(f"budget {budget / 2**30:.2f} GiB of activations: {choice.policy} keeps "
      f"{choice.activation_GiB:.2f} GiB and recomputes "
      f"{choice.recompute_percent:.1f}% of a step")
choice_report = comparison.reports[choice.policy]
print("where it keeps them (GiB by module):")
for module, nbytes in choice_report.by_module(depth=1).items():
  print(f"  {module:12s} {nbytes / 2**30:.3f}")

# %% [markdown]
# ## Attention kernels flip the ranking
#
# Which sub-block to recompute depends on the attention kernel. The naive core
# keeps the seq x seq logits and probabilities of every head: keeping all of
# attention costs four times what keeping all of the FFN does. A memory-efficient
# kernel keeps only q, k, v, its output and a log-sum-exp per query, so the FFN
# becomes the larger of the two, and recomputing the FFN frees more memory than
# recomputing attention. The built-in models take `attention="naive"`,
# `"dot_product"` (`jax.nn.dot_product_attention`) or `"flash"` (a blockwise
# `custom_vjp` kernel); the cell below measures, per layer, what keeping every
# tensor the model tags in each sub-block adds to `boundary-only`.
# `benchmarks/attention_cores.py` prints the full comparison, the named
# policies and where the ranking flips as the sequence grows (docs: Attention
# kernels).

# %%
keep_all = {"attention": rt.Policy(name="keep-all-attention", save=["attn.*"]),
            "FFN": rt.Policy(name="keep-all-ffn", save=["ffn.*"])}
for core in ("naive", "flash"):
  fn, core_args = models.build_loss(models.get_config("gpt2-small", attention=core))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # read below
    core_comparison = rt.compare(fn, *core_args,
                                 policies=["boundary-only", *keep_all.values()])
  kept = core_comparison.reports
  floor = kept["boundary-only"].activation_bytes
  per_layer = {part: (kept[p.name].activation_bytes - floor) / config.num_layers
               for part, p in keep_all.items()}
  larger = max(per_layer, key=per_layer.get)
  print(f"{core:6s} keep all of attention {per_layer['attention'] / 2**20:6.1f} MiB, "
        f"all of the FFN {per_layer['FFN'] / 2**20:6.1f} MiB per layer: "
        f"recompute the {larger} to free the most")

# %% [markdown]
# The flash kernel's comparison says one more thing: under `boundary-only` the
# kernel's forward runs again in the backward pass, since its backward rule
# reads residuals (its output, the log-sum-exp) that the policy does not keep;
# the finding counts that work and names the fix.

# %%
for finding in core_comparison.warnings:
  if finding.kind == "kernel-rerun":
    print(finding)
