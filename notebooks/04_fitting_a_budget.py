# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Fitting a memory budget: breakdown, then plan
#
# Two questions come before choosing a policy for a long training run:
#
# 1. **Will remat help at all?** Remat only trades *activation* memory for
#    recompute. If parameters, gradients or optimizer state take most of the
#    memory, no policy rescues an out-of-memory error. `rt.memory_breakdown`
#    says which case you are in.
# 2. **Which policy fits?** `rt.plan` finds, for a byte budget, the policy with
#    the least recompute whose activations fit, deciding per checkpoint name
#    whether to keep or recompute it, and measures the built-in policies
#    against the same budget.
#
# Both run on abstract shapes of the built-in GPT-2 small model, so nothing is
# allocated; the training step at the end runs on a tiny configuration.

# %%
import itertools
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax

import remat_toolkit as rt
from remat_toolkit import models

config = models.get_config("gpt2-small")
loss_fn, (params, batch) = models.build_loss(config)
optimizer = optax.adamw(1e-3)

# %% [markdown]
# ## Where the memory of a training step goes
#
# `rt.memory_breakdown(loss, params, batch, optimizer=...)` counts the
# parameters, their gradients, the optimizer state (from
# `jax.eval_shape(optimizer.init, params)`), the batch, and the activations kept
# for the backward pass under the ambient policy (`boundary-only` here). It also
# gives the range remat can move the activations over: from `boundary-only`
# (least memory) to `save-everything` (no remat). The bold row is the largest
# category, and the closing paragraph says whether remat is the right tool.
# XLA's temporary buffers come on top of this total.

# %%
breakdown = rt.memory_breakdown(loss_fn, params, batch, optimizer=optimizer)
breakdown

# %% [markdown]
# ## A budget for the activations
#
# The planner's budget covers the activations only. Derive it from the device:
# take its memory, leave headroom for XLA's temporaries, and subtract what
# remat cannot change (parameters, gradients, optimizer state, inputs). The
# device size below is an example; put your accelerator's here.

# %%
GiB = 2**30
device_memory = 6 * GiB
headroom = 0.10  # for XLA's temporary buffers
fixed = breakdown.state_bytes + breakdown.input_bytes
budget = int(device_memory * (1 - headroom)) - fixed
print(f"device {device_memory / GiB:.1f} GiB, {headroom:.0%} headroom, "
      f"parameters + gradients + optimizer state + inputs "
      f"{fixed / GiB:.2f} GiB")
print(f"activation budget: {budget / GiB:.2f} GiB (remat range "
      f"{breakdown.boundary_only_bytes / GiB:.2f} .. "
      f"{breakdown.save_everything_bytes / GiB:.2f} GiB)")
assert breakdown.boundary_only_bytes <= budget, "no policy fits this device"

# %% [markdown]
# ## The plan
#
# `rt.plan(loss, params, batch, budget=...)` searches keep/recompute decisions
# per checkpoint name (each name covers that tensor in every layer), measuring
# each candidate with the residual analyzer on a program traced once. The
# printout gives the planned policy's bytes and recompute, whether the search
# finished (which proves the plan has the least recompute of any such choice),
# the decision for every name, and every built-in policy measured against the
# same budget. A budget below what `boundary-only` keeps raises a `ValueError`
# that says how much that is; `allow_offload=True` also considers moving names
# to host memory.

# %%
plan = rt.plan(loss_fn, params, batch, budget=budget)
print(plan)

# %% [markdown]
# The same numbers as attributes: the policy itself (an ordinary `rt.Policy`:
# the names it keeps), its device bytes and recompute, and the built-in
# policies that fit, least recompute first.
#
# The budget bounds the activations kept for the backward pass. While one
# region is recomputed its internals are alive as well: the *estimated peak*
# adds that workspace. If the estimated peak exceeds the budget, leave more
# headroom, or pass `groups=` to `rt.plan` (other layouts of the model, by
# blocks per remat region) so that the budget bounds the estimated peak instead.

# %%
print("policy:", plan.policy.name)
print("  keeps:", ", ".join(plan.policy.save) or "(nothing named)")
print(f"  {plan.activation_bytes / GiB:.2f} GiB of activations for a budget of "
      f"{plan.budget / GiB:.2f} GiB; recompute {plan.recompute_percent:.1f}% "
      f"of a no-remat step ({plan.recompute_flops / 1e9:.1f} GFLOP)")
print(f"  estimated peak {plan.estimated_peak / GiB:.2f} GiB (workspace "
      f"{plan.workspace_bytes / GiB:.2f} GiB); within the budget: "
      f"{plan.estimated_peak <= budget}")
print("closest built-ins that fit:")
for fit in plan.closest_builtins:
  print(f"  {fit.name:30s} {fit.activation_bytes / GiB:.2f} GiB, "
        f"recompute {fit.recompute_percent:.1f}%")

# %% [markdown]
# ## A different policy per layer
#
# A uniform plan gives every block the same policy, so between two such
# choices the memory/recompute curve jumps, and part of the budget goes
# unused. `per_layer=True` chooses a policy for each remat region: the exact
# answer to a multiple-choice knapsack over measured per-region candidates
# (structurally identical blocks are measured once), then measured on the
# whole program. Its table lists the regions by module path, in runs of equal
# policy; `keeps` is what a region holds beyond its inputs.

# %%
per_layer = rt.plan(loss_fn, params, batch, budget=budget, per_layer=True)
print(per_layer)
print(f"\nrecompute: per-region {per_layer.recompute_percent:.2f}%, uniform "
      f"plan {plan.recompute_percent:.2f}%, best named "
      f"{plan.best_builtin.recompute_percent:.2f}%")
assert per_layer.recompute_flops <= plan.recompute_flops

# %% [markdown]
# `with rt.use_policy(per_layer):` gives each region its own planned policy when
# the step is traced (regions are matched by module path, `layers_3` here);
# `rt.remat_modules(model, per_layer.rules)` does the same for a model you
# cannot edit, and `rt.scan_layers(Block, L, policy=per_layer)` builds a scanned
# stack as consecutive scans of equal policy. Applied, the plan keeps what it
# says: JAX's own `print_saved_residuals`, with the model traced under the plan,
# lists as many residuals as the plan's report.

# %%
import contextlib  # noqa: E402
import io  # noqa: E402

listing = io.StringIO()
with rt.use_policy(per_layer), contextlib.redirect_stdout(listing):
  jax.ad_checkpoint.print_saved_residuals(loss_fn, params, batch)
jax_lines = listing.getvalue().strip().splitlines()
print(f"JAX lists {len(jax_lines)} residuals under the plan; the plan's report "
      f"has {len(per_layer.report.residuals)}")
assert len(jax_lines) == len(per_layer.report.residuals)

# %% [markdown]
# ### The dense frontier
#
# `rt.frontier(..., per_layer=True)` plans at every step of the per-region
# front: the diamonds fill the gaps between the named policies (dots), whose own
# front is the dashed line. Any budget between two named points buys less
# recompute.

# %%
dense = rt.frontier(loss_fn, params, batch, per_layer=True)
# The memory axis ends past the largest plan: save-everything, far right, is left out.
ax = dense.plot(max_bytes=1.15 * max(p.activation_bytes for p in dense.points
                                     if p.source != "named"))
per_region_points = [p for p in dense.points if p.source == "per-region plan"]
print(f"{len(per_region_points)} per-region plans between "
      f"{per_region_points[0].activation_bytes / GiB:.2f} and "
      f"{per_region_points[-1].activation_bytes / GiB:.2f} GiB")

# %% [markdown]
# ## The step's peak: `rt.peak`
#
# The budget above bounds the activations kept for the backward pass. What
# decides an out-of-memory error is the *peak* of the training step: the
# parameters, the batch, the gradients and everything else live at the worst
# moment of the step as XLA lays it out. `rt.peak(loss, params, batch,
# policy=...)` predicts it from the program, on abstract shapes and without
# compiling (a liveness walk over `jax.jit(jax.grad(loss))` that models XLA's
# fusion), and lists the tensors live then, each with its phase (parameter,
# input, gradient, kept residual, forward or backward transient) and the
# module that made it; `compile=True` adds XLA's own figure (`xla_bytes`).
# Here on GPT-2 small cut to 4 layers, seq 256, batch 4, the shape of
# `benchmarks/peak_accuracy.py`: `by_phase()` and `by_module()` (activations
# and transients only) as charts.

# %%
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

MiB = 2**20
small = config.replace(num_layers=4, seq_len=256, batch_size=4)
small_loss, (small_params, small_batch) = models.build_loss(small)
peak = rt.peak(small_loss, small_params, small_batch, policy="save-attention")
print(f"predicted peak {peak.bytes / MiB:,.1f} MiB, at the {peak.when}; "
      f"the policy keeps {peak.kept_bytes / MiB:,.1f} MiB of activations")
assert sum(t.nbytes for t in peak.live) == peak.bytes

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.5))
for ax, parts, title in ((left, peak.by_phase(), "by phase"),
                         (right, peak.by_module(), "by module (activations, transients)")):
  ax.barh(list(parts), [b / MiB for b in parts.values()])
  ax.invert_yaxis()
  ax.set_xlabel("MiB live at the predicted peak")
  ax.set_title(title)
fig.tight_layout()

# %% [markdown]
# Kept bytes and the peak need not rank policies alike: a policy that keeps
# more may free a larger transient earlier, and what every policy holds at
# the peak (here the loss over the 50,257-token vocabulary, in the backward
# pass) shrinks the differences. Both rankings side by side, and the pairs
# they order differently:

# %%
names = ["boundary-only", "save-qkv", "save-ffn", "save-attention",
         "recompute-attention-core", "save-everything"]
peaks = {name: rt.peak(small_loss, small_params, small_batch, policy=name)
         for name in names}
rankings = pd.DataFrame({
    "kept MiB": {n: p.kept_bytes / MiB for n, p in peaks.items()},
    "predicted peak MiB": {n: p.bytes / MiB for n, p in peaks.items()},
})
rankings["rank by kept"] = rankings["kept MiB"].rank(method="min").astype(int)
rankings["rank by peak"] = rankings["predicted peak MiB"].rank(method="min").astype(int)
kept, top = rankings["kept MiB"], rankings["predicted peak MiB"]
print(f"kept bytes span {kept.max() / kept.min():.2f}x, the predicted peak "
      f"{top.max() / top.min():.2f}x")
for a, b in itertools.combinations(names, 2):
  if (kept[a] - kept[b]) * (top[a] - top[b]) < 0:
    print(f"ordered differently: {a} and {b}")
rankings.round(1)

# %% [markdown]
# ## Keep the plan: save it, load it by name
#
# `rt.save_policy(plan, path)` writes the plan's policy as a TOML file in the
# catalogue's format (its description says what it keeps and recomputes, for
# which budget), and `rt.load_policies(path)` adds it to
# the catalogue, so that code and the `remat-toolkit` command line can select it
# by name (`override=True` lets this cell run twice). Analysing the loaded
# policy by name gives back the plan's numbers.

# %%
with tempfile.TemporaryDirectory() as folder:
  path = rt.save_policy(plan, pathlib.Path(folder) / f"{plan.policy.name}.toml")
  print(path.read_text())
  loaded = rt.load_policies(path, override=True)
print("loaded policy:", [p.name for p in loaded])

check = rt.analyze(loss_fn, params, batch, policy=plan.policy.name)
print(f"by name: {check.activation_bytes / GiB:.2f} GiB, recompute "
      f"{check.recompute_percent:.1f}%")
assert check.activation_bytes == plan.activation_bytes
assert check.recompute_flops == plan.recompute_flops

# %% [markdown]
# ## Train with it
#
# The loaded policy works like a built-in one: inside `rt.use_policy(name)`,
# the model's remat regions take it when the training step is traced. The step
# below is a jitted AdamW step on the `tiny` configuration of the same model
# (its blocks carry the same checkpoint names), small enough for a CPU.

# %%
tiny = models.get_config("tiny")
tiny_loss, (tiny_abstract, _) = models.build_loss(tiny)
rng = np.random.default_rng(0)
tokens = rng.integers(0, tiny.vocab_size, size=(tiny.batch_size, tiny.seq_len + 1),
                      dtype=np.int32)
tiny_batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
tiny_params = jax.jit(models.GPT(tiny).init)(
    jax.random.key(0), tiny_batch["inputs"])["params"]
assert (jax.tree_util.tree_structure(tiny_params)
        == jax.tree_util.tree_structure(tiny_abstract))


def train_step(params, opt_state, batch):
  value, grads = jax.value_and_grad(tiny_loss)(params, batch)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


opt_state = optimizer.init(tiny_params)
with rt.use_policy(plan.policy.name):
  step = jax.jit(train_step)
  for i in range(3):
    tiny_params, opt_state, value = step(tiny_params, opt_state, tiny_batch)
    print(f"step {i}: loss {float(value):.4f}")
assert bool(jnp.isfinite(value))
