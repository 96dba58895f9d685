# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Selective remat on a model you cannot edit
#
# Most models come from a library: there is no place to put `rt.remat` or
# `rt.tag` in their code. `rt.remat_modules(model, rules)` applies remat from
# the outside: every submodule matched by a rule becomes one remat region, and
# with `tag_outputs=True` the outputs of the submodules inside each region are
# named by their path relative to the region (`attn/query`, `mlp`). The
# built-in selective policies select those names: `save-attention` keeps
# names matching `*attn/*` and `*attention/*`, `save-ffn` keeps `*mlp/*` and
# `*ffn/*`, among others.

# %%
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd

import remat_toolkit as rt

# %% [markdown]
# ## The library's model
#
# Treat the next cell as code from another package: a small transformer encoder
# built only from flax's own `nn.MultiHeadDotProductAttention`, `nn.Dense` and
# `nn.LayerNorm`. It has no remat and no checkpoint names. Its blocks are named
# by Flax (`Block_0`, `Block_1`, ...); inside a block, the attention submodule is
# called `attn` and the feed-forward one `mlp`.

# %%
class MlpBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.hidden)(x))
    return nn.Dense(x.shape[-1])(h)


class Block(nn.Module):
  num_heads: int
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                            name="attn")(h)
    h = nn.LayerNorm()(x)
    return x + MlpBlock(self.hidden, name="mlp")(h)


class Encoder(nn.Module):
  num_layers: int = 2
  d_model: int = 64
  num_heads: int = 4
  hidden: int = 256
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.d_model)(x)
    for _ in range(self.num_layers):
      x = Block(self.num_heads, self.hidden)(x)
    return nn.Dense(self.num_classes)(nn.LayerNorm()(x).mean(axis=1))

# %% [markdown]
# ## Apply remat from the outside
#
# The rule `{"Block_*": None}` matches the blocks by module path (a class name
# such as `"Block"` works too) and gives them the ambient policy, so
# `rt.compare` can try each policy on the same model. The wrapped model is used
# exactly like the original: same `init` and `apply`, same variables.

# %%
model = Encoder()
remat_model = rt.remat_modules(model, {"Block_*": None}, tag_outputs=True)

rng = np.random.default_rng(0)
x = rng.standard_normal((4, 32, 16), dtype=np.float32)
labels = rng.integers(0, 10, size=(4,), dtype=np.int32)
batch = {"x": x, "labels": labels}
params = jax.jit(model.init)(jax.random.key(0), x)["params"]
# The wrapped model's variables, from shapes only (nothing is computed).
remat_params = jax.eval_shape(remat_model.init, jax.random.key(0), x)["params"]
same = (jax.tree_util.tree_map(jnp.shape, params)
        == jax.tree_util.tree_map(jnp.shape, remat_params))
print("same parameter tree and shapes:", same)
print("block 0:", jax.tree_util.tree_map(jnp.shape, params["Block_0"]))
assert same


def make_loss(m):
  def loss(params, batch):
    logits = m.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["labels"]).mean()
  return loss


loss = make_loss(remat_model)

# %% [markdown]
# ## Compare the selective policies
#
# The comparison uses abstract shapes (`jax.ShapeDtypeStruct`), as for a model
# too big to allocate. `save-everything` and `boundary-only` bracket the two
# selective policies.

# %%
abstract = jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, batch))
policies = ["save-everything", "save-attention", "save-ffn", "boundary-only"]
comparison = rt.compare(loss, *abstract, policies=policies)
comparison

# %% [markdown]
# ## What each policy keeps
#
# Each residual's checkpoint name is the path of the submodule that made it,
# relative to its block. Grouping the kept bytes by the first part of the name
# shows the choice each policy makes: `save-attention` keeps the outputs of the
# `attn` submodules (the query, key and value projections and the attention
# output), `save-ffn` keeps outputs of `mlp`'s layers, and `boundary-only` keeps
# neither: only the blocks' inputs and what lies outside the blocks. Unnamed
# residuals (`untagged`) are values that no submodule returned, such as the
# residual additions. The cell after the table prints the kept names.

# %%
def kept_by_submodule(report):
  kept = {}
  for r in report.activations:
    group = r.name.split("/")[0] if r.name else "untagged"
    kept[group] = kept.get(group, 0) + r.nbytes
  return kept


table = pd.DataFrame({name: kept_by_submodule(r)
                      for name, r in comparison.reports.items()}).fillna(0)
(table / 2**10).round(1).rename_axis("KiB kept by").astype(float)

# %%
for name in ("save-attention", "save-ffn", "boundary-only"):
  names = sorted({r.name for r in comparison.reports[name].activations
                  if r.name})
  print(f"{name:15s} keeps named: {names}")

attn_kept = {r.name for r in comparison.reports["save-attention"].activations
             if r.name}
ffn_kept = {r.name for r in comparison.reports["save-ffn"].activations if r.name}
boundary_kept = {r.name for r in comparison.reports["boundary-only"].activations
                 if r.name}
assert attn_kept and all(n.startswith("attn") for n in attn_kept)
assert ffn_kept and all(n.startswith("mlp") for n in ffn_kept)
assert not boundary_kept

# %% [markdown]
# ## Same gradients as the original model
#
# The wrapped model computes the same function: its gradient under a selective
# policy equals the original model's gradient (the report above is what shows
# that the policy changed what is stored).

# %%
reference = jax.jit(jax.grad(make_loss(model)))(params, batch)
with rt.use_policy("save-attention"):
  grads = jax.jit(jax.grad(loss))(params, batch)
diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
    jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference),
    strict=True))
print(f"largest gradient difference: {diff:.2e}")
for a, b in zip(jax.tree_util.tree_leaves(grads),
                jax.tree_util.tree_leaves(reference), strict=True):
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

# %% [markdown]
# ## A policy of your own, with the model's names
#
# The names `tag_outputs` gives are ordinary checkpoint names, so a policy can
# list them directly. `rt.Policy` builds one in Python (`rt.register_policy`
# adds it to the catalogue by name, and a TOML file in the same format does the
# same with `rt.load_policies`). This one keeps only the key and value
# projections.

# %%
save_kv = rt.Policy(name="save-kv-projections",
                    description="Keeps the key and value projections.",
                    save=("attn/key", "attn/value"))
report = rt.analyze(loss, *abstract, policy=save_kv)
print("\n".join(report.summary_lines()))
print({k: v for k, v in report.by_name().items() if not k.startswith("<")})
