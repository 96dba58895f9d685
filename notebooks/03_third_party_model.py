# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Selective remat on a model you cannot edit
#
# Most models come from a library: there is no place to put `rt.remat` or
# `rt.tag` in their code. `rt.remat_modules(model)` applies remat from the
# outside. Without rules it finds the model's repeated blocks itself, makes
# each one remat region that reads the ambient policy, and names the outputs
# of the submodules inside each region by their path relative to the region
# (`attn/c_attn`, `mlp/c_fc`). The built-in selective policies select those
# names: `save-attention` keeps names matching `*attn/*` and `*attention/*`,
# `save-ffn` keeps `*mlp/*` and `*ffn/*`, among others.
#
# The model here is Hugging Face's Flax GPT-2 (`transformers`, 4.x), built from
# a small config: nothing is downloaded.

# %%
# transformers imports tqdm, which warns that Jupyter's progress widgets are
# not installed; nothing here shows a progress bar.
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pandas as pd
import transformers

import remat_toolkit as rt

# %% [markdown]
# ## The library's model
#
# `FlaxGPT2LMHeadModel(config, _do_init=False)` builds the model without
# initialising weights; its `.module` is the plain linen module, called with
# `input_ids`, `attention_mask` and `position_ids`. Nothing in it was written
# for remat: no checkpoint names, no remat regions.

# %%
config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4,
                                 vocab_size=256, n_positions=64)
model = transformers.FlaxGPT2LMHeadModel(config, _do_init=False).module

rng = np.random.default_rng(0)
ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(4, 64)), jnp.int32)
batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
         "position_ids": jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)}
params = jax.jit(model.init)(jax.random.key(0), **batch)["params"]
print("blocks:", sorted(params["transformer"]["h"]))
print("block 0:", jax.tree_util.tree_map(jnp.shape,
                                         params["transformer"]["h"]["0"]))

# %% [markdown]
# ## Apply remat from the outside
#
# `rt.remat_modules(model)` with no rules. A linen model's submodules are known
# only when it runs, so the blocks are found at its first `init` or `apply`,
# from one abstract trace (nothing is computed or allocated);
# `rt.remat_summary` then says what was chosen. The wrapped model is used
# exactly like the original: same `init` and `apply`, same variables. (To
# choose the regions yourself, pass rules instead, e.g.
# `rt.remat_modules(model, {"FlaxGPT2Block": None})`.)

# %%
remat_model = rt.remat_modules(model)
# The wrapped model's variables, from shapes only.
remat_params = jax.eval_shape(remat_model.init, jax.random.key(0),
                              **batch)["params"]
print(rt.remat_summary(remat_model))
same = (jax.tree_util.tree_map(jnp.shape, params)
        == jax.tree_util.tree_map(jnp.shape, remat_params))
print("same parameter tree and shapes:", same)
assert same
assert rt.remat_summary(remat_model).classes == ("FlaxGPT2Block",)


def make_loss(m):
  def loss(params, batch):
    logits = m.apply({"params": params}, **batch).logits
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], batch["input_ids"][:, 1:]).mean()
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
# shows the choice each policy makes: `save-attention` keeps outputs of the
# `attn` submodule (GPT-2's fused query/key/value projection `c_attn`, and the
# attention output), `save-ffn` keeps outputs of `mlp`'s layers, and
# `boundary-only` keeps neither: only the blocks' inputs and what lies outside
# the blocks. Unnamed residuals (`untagged`) are values that no submodule
# returned, such as the residual additions. The cell after the table prints
# the kept names.

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
# The names the regions give are ordinary checkpoint names, so a policy can
# list them directly. `rt.Policy` builds one in Python (`rt.register_policy`
# adds it to the catalogue by name, and a TOML file in the same format does the
# same with `rt.load_policies`). This one keeps only GPT-2's fused query, key
# and value projection.

# %%
save_qkv = rt.Policy(name="save-qkv-projection",
                     description="Keeps GPT-2's fused q/k/v projection.",
                     save=("attn/c_attn",))
report = rt.analyze(loss, *abstract, policy=save_qkv)
print("\n".join(report.summary_lines()))
print({k: v for k, v in report.by_name().items() if not k.startswith("<")})
