# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quickstart: remat a Flax model with a named policy
#
# Rematerialization (*remat*) trades memory for compute: a remat region keeps
# only some of its intermediate values (the *residuals*) for the backward pass
# and recomputes the others there. A *policy* says which values are kept.
#
# This notebook wraps the block of a small Flax linen model with `rt.remat`,
# chooses a policy by name with `rt.use_policy`, inspects what the policy keeps
# with `rt.analyze`, and checks that a training step gives the same result as
# the model without remat.

# %%
import contextlib
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import remat_toolkit as rt

print(f"jax {jax.__version__}, remat_toolkit {rt.__version__}, "
      f"backend {jax.default_backend()}")

# %% [markdown]
# ## A model with a remat region
#
# `Block` is an ordinary linen module: a pre-norm feed-forward block. Two of its
# tensors are *tagged* with `rt.tag(x, name)`, a JAX checkpoint name that lets a
# policy select the tensor by name. The built-in policies use the names of
# `remat_toolkit.names.VOCABULARY` (`ffn.up`, `attn.q`, ...), so tagging with
# those names makes every built-in policy meaningful for this block.
#
# `rt.remat(Block)` is used like `nn.remat(Block)`: it returns a class whose
# every call is one remat region. No policy is given, so the region reads the
# *ambient* policy when it is traced: the one set by `rt.use_policy`, or
# `boundary-only` outside any such block. (`@rt.remat` also decorates a
# `__call__` method in the class body.) The model takes the block class as a
# field so that the same parameters run with and without remat below.

# %%
class Block(nn.Module):
  """Pre-norm feed-forward block with a residual connection."""

  d_model: int
  d_ff: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(x)
    up = rt.tag(nn.Dense(self.d_ff, name="up")(h), "ffn.up")
    down = rt.tag(nn.Dense(self.d_model, name="down")(nn.gelu(up)), "ffn.down")
    return x + down


RematBlock = rt.remat(Block)  # policy=None: the ambient policy, read at trace time


class Model(nn.Module):
  """A stack of blocks and a linear head."""

  block: type = RematBlock
  num_layers: int = 3
  d_model: int = 64
  d_ff: int = 256

  @nn.compact
  def __call__(self, x):
    for i in range(self.num_layers):
      x = self.block(self.d_model, self.d_ff, name=f"block_{i}")(x)
    return nn.Dense(1, name="head")(x)


def make_loss(model):
  def loss(params, batch):
    pred = model.apply({"params": params}, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2)
  return loss


model = Model()
rng = np.random.default_rng(0)
batch = {"x": rng.standard_normal((8, 32, 64), dtype=np.float32),
         "y": rng.standard_normal((8, 32, 1), dtype=np.float32)}
params = jax.jit(model.init)(jax.random.key(0), batch["x"])["params"]
loss = make_loss(model)
print(jax.tree_util.tree_map(jnp.shape, params))

# %% [markdown]
# ## Choose a policy by name and see what it keeps
#
# `rt.list_policies()` names the catalogue. Inside `with rt.use_policy(...)`,
# every region left without a policy uses that one. `rt.analyze(loss, params,
# batch)` traces the loss once and lists every residual the backward pass keeps:
# the summary gives the bytes kept on device and the recompute, in FLOPs of
# matrix multiplications and as a percentage of a training step without remat;
# the table groups the residuals kept for the backward pass by module and by
# name. Unnamed residuals appear as the primitive that made them: `<add>` is
# each block's output, the input that the next region (or the head) needs when
# it runs backward.

# %%
print(rt.list_policies())
print("ambient policy outside any block:", rt.current_policy().name)

with rt.use_policy("save-ffn") as policy:
  print(f"{policy.name}: {policy.description}\n")
  report = rt.analyze(loss, params, batch)

print(report)

# %% [markdown]
# The same residuals as data: bytes per checkpoint name, and one row per
# residual as a pandas DataFrame. The first rows are *arguments* (parameters and
# inputs that the backward pass reads; they are in memory anyway); the rows with
# `kind == "activation"` are what the policy chooses to keep.

# %%
report.by_name()

# %%
df = report.to_dataframe()
df.head()

# %%
df[df.kind == "activation"][["name", "module_path", "shape", "dtype", "nbytes",
                             "primitive"]].head()

# %% [markdown]
# The report is built on what JAX itself saves. As a cross-check, JAX's public
# `jax.ad_checkpoint.print_saved_residuals` prints one line per residual for the
# same function under the same policy; the count should equal the report's.

# %%
listing = io.StringIO()
with rt.use_policy("save-ffn"), contextlib.redirect_stdout(listing):
  jax.ad_checkpoint.print_saved_residuals(loss, params, batch)
jax_lines = listing.getvalue().strip().splitlines()
print(f"JAX lists {len(jax_lines)} residuals; the report has "
      f"{len(report.residuals)}.")
assert len(jax_lines) == len(report.residuals)

# %% [markdown]
# ## Other policies, same model
#
# `policy=` on `rt.analyze` is a shortcut for the `use_policy` block. The two
# extremes of the catalogue bracket every policy: `boundary-only` keeps only each
# region's inputs and recomputes the whole region, `save-everything` keeps every
# residual and recomputes nothing. The recompute counts matrix multiplications
# only, so a policy that recomputes just element-wise work (norms, activations)
# shows 0%. Notebook 02 compares the whole catalogue.

# %%
for name in ("boundary-only", "save-ffn", "save-everything"):
  r = rt.analyze(loss, params, batch, policy=name)
  print(f"{name:16s} {r.activation_bytes / 2**10:8.1f} KiB kept, "
        f"{len(r.activations):3d} activation residuals, "
        f"recompute {r.recompute_percent:5.1f}% of a no-remat step")

# %% [markdown]
# ## A training step gives the same result
#
# Remat changes what is stored and what is recomputed, not the result: one
# AdamW step with the remat model must match the same step with the plain
# `Block`, from the same parameters. The policy is read when `jax.jit`
# *traces*, and a jitted function keeps the program of its first trace for
# arguments of the same shapes, so each policy gets its own freshly jitted step,
# built and first called inside its `use_policy` block.
#
# Equal results alone would not show that remat did anything (a region that
# keeps everything also passes); the reports above show what each policy keeps.

# %%
optimizer = optax.adamw(1e-3)


def make_step(loss_fn):
  @jax.jit
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


opt_state = optimizer.init(params)
reference, _, ref_loss = make_step(make_loss(Model(block=Block)))(
    params, opt_state, batch)
for name in ("boundary-only", "save-ffn"):
  with rt.use_policy(name):
    updated, _, value = make_step(loss)(params, opt_state, batch)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree_util.tree_leaves(updated), jax.tree_util.tree_leaves(reference),
      strict=True))
  print(f"{name:14s} loss {float(value):.6f} (plain {float(ref_loss):.6f}), "
        f"largest parameter difference after the step {diff:.2e}")
  np.testing.assert_allclose(value, ref_loss, rtol=1e-6)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      updated, reference)

# %% [markdown]
# Next: `02_choosing_a_policy` compares every built-in policy on GPT-2 small and
# reads the memory/recompute trade-off; `03_third_party_model` applies policies
# to a model you cannot edit; `04_fitting_a_budget` plans a policy for a memory
# budget.
