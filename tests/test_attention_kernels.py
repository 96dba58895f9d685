"""Attention kernels in a 2-layer model: what the analyzer says is what JAX does.

Every kernel kind that traces on a CPU sits in the ``rt.remat`` regions of a
two-layer attention model: Pallas GPU ``mha`` (interpret mode, runs here),
TPU ``flash_attention`` and splash attention (traced on abstract inputs),
``jax.nn.dot_product_attention`` (``xla``) and a ``jax.custom_vjp``
blockwise kernel written here (a ``lax.scan`` over key blocks keeping q, k,
v, the output and the log-sum-exp), with and without names inside its
forward rule. For each, in both remat modes: the bytes equal JAX's
``saved_residuals``, the FLOPs equal the count written out below, and the
kernels whose forward runs again are the ones JAX's own program runs again.
"""

import dataclasses
import functools
import importlib
import json
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from shared_helpers import custom_vjp3_enabled
from shared_helpers import custom_vjp_alignment
from shared_helpers import has_custom_vjp3_flag
from shared_helpers import jax_activation_bytes
from shared_helpers import remat3 as jax_remat3
from shared_helpers import remat3_everything_keeps_unnamed
from shared_helpers import remat3_sees_into_custom_vjp
from shared_helpers import without_dead_code

import remat_toolkit as rt

pytestmark = pytest.mark.usefixtures("quick_compiles")

S = jax.ShapeDtypeStruct
NAME_POLICY = "save-attention"  # names the kernel's output only, from outside
POLICIES = ["save-everything", NAME_POLICY, "boundary-only", "save-matmuls",
            "save-matmuls-no-batch"]
#: Keeps the projections, the context and the names a kernel gives its own
#: residuals inside its forward rule.
KEEP_KERNEL = rt.Policy(name="save-attention-and-kernel",
                        save=("attn.q", "attn.k", "attn.v", "attn.context",
                              "kernel.*"))
LAYERS = 2


# ------------------------------------------------------------ the kernels

def blockwise_attention(block: int, name: str | None = None) -> Callable:
  """A flash-attention kernel: ``lax.scan`` over key blocks with a running
  max and sum, keeping q, k, v, the output and the log-sum-exp.

  ``name``: tag the output and log-sum-exp inside the forward rule (what
  ``rt.tag_residuals`` and splash's ``residual_checkpoint_name`` do).
  """
  def forward(q, k, v):
    b, t, n, d = q.shape
    blocks = k.shape[1] // block
    kb = k.reshape(b, blocks, block, n, d).swapaxes(0, 1)
    vb = v.reshape(b, blocks, block, n, d).swapaxes(0, 1)

    def step(carry, kv):
      m, total, acc = carry
      s = jnp.einsum("btnd,bsnd->bnts", q, kv[0])
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      scale = jnp.exp(m - m_new)
      acc = acc * scale[..., None] + jnp.einsum("bnts,bsnd->bntd", p, kv[1])
      return (m_new, total * scale + p.sum(-1), acc), None

    init = (jnp.full((b, n, t), -jnp.inf, q.dtype),
            jnp.zeros((b, n, t), q.dtype), jnp.zeros((b, n, t, d), q.dtype))
    (m, total, acc), _ = lax.scan(step, init, (kb, vb))
    return (acc / total[..., None]).transpose(0, 2, 1, 3), m + jnp.log(total)

  @jax.custom_vjp
  def flash(q, k, v):
    return forward(q, k, v)[0]

  def flash_fwd(q, k, v):
    out, lse = forward(q, k, v)
    if name is not None:
      out = jax.ad_checkpoint.checkpoint_name(out, f"{name}.out")
      lse = jax.ad_checkpoint.checkpoint_name(lse, f"{name}.lse")
    return out, (q, k, v, out, lse)

  def flash_bwd(res, g):
    q, k, v, out, lse = res
    p = jnp.exp(jnp.einsum("btnd,bsnd->bnts", q, k) - lse[..., None])
    dv = jnp.einsum("bnts,btnd->bsnd", p, g)
    dp = jnp.einsum("btnd,bsnd->bnts", g, v)
    delta = jnp.sum(g * out, -1).transpose(0, 2, 1)
    ds = p * (dp - delta[..., None])
    return (jnp.einsum("bnts,bsnd->btnd", ds, k),
            jnp.einsum("bnts,btnd->bsnd", ds, q), dv)

  flash.defvjp(flash_fwd, flash_bwd)
  return flash


def _heads_first(x):
  return x.transpose(0, 2, 1, 3)


def _pallas_gpu_mha():
  from jax.experimental.pallas.ops.gpu import attention
  blocks = attention.BlockSizes(block_q=8, block_k=8, block_q_dkv=8,
                                block_kv_dkv=8, block_q_dq=8, block_kv_dq=8)
  return lambda q, k, v: attention.mha(q, k, v, segment_ids=None,
                                       block_sizes=blocks, interpret=True)


def _tpu_flash():
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  return lambda q, k, v: _heads_first(fa.flash_attention(
      *map(_heads_first, (q, k, v))))


def _splash(named: bool, heads: int, seq: int):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask
  splash, masks = splash_attention_kernel, splash_attention_mask
  mask = masks.MultiHeadMask([masks.FullMask((seq, seq))] * heads)
  extra = {"residual_checkpoint_name": "kernel.splash"} if named else {}
  kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, **extra)
  # One sequence at a time, as splash takes it (batch 1 here).
  return lambda q, k, v: _heads_first(kernel(
      *(_heads_first(x)[0] for x in (q, k, v)))[None])


@dataclasses.dataclass(frozen=True)
class Kind:
  """One attention kernel and what JAX does with it."""

  name: str
  make: Callable[[int, int], Callable]  # (heads, seq) -> kernel(q, k, v)
  seq: int  # T = S
  head_dim: int
  kernel: str | None  # Residual.kernel of what it makes; None: no kernel
  #: Forward FLOPs of one call on [B, T, N, D] inputs.
  flops: Callable[[int, int, int, int], int]
  names_inside: bool = False  # names its residuals inside its forward rule
  module: str | None = None  # the Pallas module it needs


def _attention_flops(b, n, t, d):
  # Logits q @ k^T and probabilities @ v: 2 * T * S * D each, per head.
  return 2 * (2 * b * n * t * t * d)


KINDS = [
    Kind("pallas_gpu_mha", lambda n, t: _pallas_gpu_mha(), 16, 16, "mha",
         _attention_flops, module="jax.experimental.pallas.ops.gpu.attention"),
    # Its cost_estimate: XLA's count of the reference (the two matmuls, and
    # two FLOPs per logit for the softmax's subtract and divide).
    Kind("tpu_flash", lambda n, t: _tpu_flash(), 128, 128, "_flash_attention",
         lambda b, n, t, d: _attention_flops(b, n, t, d) + 2 * b * n * t * t,
         module="jax.experimental.pallas.ops.tpu.flash_attention"),
    Kind("splash", lambda n, t: _splash(False, n, t), 128, 128,
         "_splash_attention_custom", _attention_flops,
         module="jax.experimental.pallas.ops.tpu.splash_attention"),
    Kind("splash_named", lambda n, t: _splash(True, n, t), 128, 128,
         "_splash_attention_custom", _attention_flops, names_inside=True,
         module="jax.experimental.pallas.ops.tpu.splash_attention"),
    Kind("dot_product_xla", lambda n, t: functools.partial(
        jax.nn.dot_product_attention, implementation="xla"), 16, 16, None,
         _attention_flops),
    Kind("blockwise", lambda n, t: blockwise_attention(8), 16, 16, "flash",
         _attention_flops),
    Kind("blockwise_named", lambda n, t: blockwise_attention(8, "kernel"), 16,
         16, "flash", _attention_flops, names_inside=True),
]
KIND_IDS = [k.name for k in KINDS]
BY_NAME = {k.name: k for k in KINDS}


# ------------------------------------------------------------ the model

BATCH, HEADS = 1, 2


def _model(kind: Kind):
  """(loss, params, x) of a 2-layer attention model using ``kind``."""
  t, d = kind.seq, kind.head_dim
  width = HEADS * d
  attend = kind.make(HEADS, t)

  def layer(p, x):
    def heads(y):
      return y.reshape(BATCH, t, HEADS, d)
    q = rt.tag(heads(x @ p["wq"]), "attn.q")
    k = rt.tag(heads(x @ p["wk"]), "attn.k")
    v = rt.tag(heads(x @ p["wv"]), "attn.v")
    o = rt.tag(attend(q, k, v), "attn.context")
    return x + jnp.tanh(o.reshape(BATCH, t, width) @ p["wo"])

  block = rt.remat(layer)

  def loss(params, x):
    for i, p in enumerate(params):
      with jax.named_scope(f"layers_{i}"):
        x = block(p, x)
    return x.sum()

  w = S((width, width), jnp.float32)
  params = [dict(wq=w, wk=w, wv=w, wo=w) for _ in range(LAYERS)]
  return loss, params, S((BATCH, t, width), jnp.float32)


def _projection_flops(kind: Kind) -> int:
  width = HEADS * kind.head_dim
  return 4 * 2 * BATCH * kind.seq * width * width  # q, k, v, out


def _kernel_flops(kind: Kind) -> int:
  return kind.flops(BATCH, HEADS, kind.seq, kind.head_dim)


@functools.cache
def _unavailable(name: str) -> str | None:
  """Why this kernel cannot be traced here (detected), None if it can."""
  kind = BY_NAME[name]
  if kind.module:
    try:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jax 0.12: "use tokamax instead"
        importlib.import_module(kind.module)
    except ImportError as e:
      return f"{kind.module} is not in this JAX: {e}"
  t, d = kind.seq, kind.head_dim
  x = S((BATCH, t, HEADS, d), jnp.float32)
  try:
    jax.eval_shape(jax.grad(lambda a: kind.make(HEADS, t)(a, a, a).sum()), x)
  except Exception as e:  # noqa: BLE001 - whatever stops it tracing here
    return f"{name} does not trace on this machine's JAX: {type(e).__name__}: {e}"
  return None


def _kind(name: str) -> Kind:
  why = _unavailable(name)
  if why:
    pytest.skip(why)
  return BY_NAME[name]


@functools.cache
def _compared(name: str, remat3: bool):
  """rt.compare of the model under POLICIES and KEEP_KERNEL, in one mode."""
  loss, params, x = _model(BY_NAME[name])
  with jax_remat3(remat3), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return rt.compare(loss, params, x, policies=[*POLICIES, KEEP_KERNEL])


def _jax_bytes(name: str, policy, remat3: bool) -> int:
  loss, params, x = _model(BY_NAME[name])
  with jax_remat3(remat3):
    return jax_activation_bytes(loss, (params, x), policy)


def _expected_reruns(kind: Kind, policy, remat3: bool) -> bool:
  """Whether JAX runs the kernel's forward again in the backward pass."""
  if kind.kernel is None:
    return False
  if policy == "save-everything":
    # jax 0.10's remat3 everything_saveable keeps only named values, and
    # sees no name inside a custom_vjp.
    return remat3 and not remat3_everything_keeps_unnamed()
  if policy is KEEP_KERNEL and kind.names_inside:
    return remat3 and not remat3_sees_into_custom_vjp()
  if policy == "save-matmuls" and kind.name.startswith("blockwise"):
    # dots_saveable keeps the kernel's per-block logits and products (its
    # forward is traced inline) unless remat3 treats the kernel as opaque.
    return remat3 and not remat3_sees_into_custom_vjp()
  return True  # the kernel's output named from outside: its lse is not kept


# ------------------------------------------------------------ bytes

@pytest.mark.parametrize("name", KIND_IDS)
def test_bytes_equal_jax_saved_residuals(name, remat_mode):
  _kind(name)
  comparison = _compared(name, remat_mode)
  for policy in [*POLICIES, KEEP_KERNEL]:
    report = comparison.reports[getattr(policy, "name", policy)]
    assert report.activation_bytes == _jax_bytes(name, policy, remat_mode), (
        report.policy)


@pytest.mark.parametrize("name", KIND_IDS)
def test_kernel_residuals_carry_the_kernel_and_where_it_was_called(
    name, remat_mode):
  kind = _kind(name)
  report = _compared(name, remat_mode).reports["save-everything"]
  made = [r for r in report.activations if r.kernel]
  projections = [r for r in report.activations if r.name in ("attn.q", "attn.k")]
  assert all(r.kernel is None for r in projections)
  if kind.kernel is None or _expected_reruns(kind, "save-everything", remat_mode):
    # No kernel, or (jax 0.10's remat3) its residuals are recomputed.
    assert all(r.kernel in (None, kind.kernel) for r in report.activations)
    return
  assert {r.kernel for r in made} == {kind.kernel}
  assert {r.module_path.split("/")[0] for r in made} == {"layers_0", "layers_1"}
  # The equation that made it, never the call it left by.
  calls = {"custom_vjp_call", "closed_call", "eval_jaxpr", "pjit", "jit"}
  assert not {r.primitive for r in report.activations} & calls


# ------------------------------------------------------------ FLOPs

@pytest.mark.parametrize("name", KIND_IDS)
def test_forward_flops_are_the_analytic_count(name):
  kind = _kind(name)
  report = _compared(name, False).reports["save-everything"]
  # A Pallas kernel counts its cost_estimate, else its body once per grid
  # step; a custom_vjp kernel's scan counts once per key block.
  assert report.forward_flops == LAYERS * (_projection_flops(kind)
                                           + _kernel_flops(kind))


@pytest.mark.parametrize("name", ["pallas_gpu_mha", "blockwise", "tpu_flash"])
def test_recompute_under_a_name_policy_counts_the_kernel_run_again(
    name, remat_mode):
  kind = _kind(name)
  report = _compared(name, remat_mode).reports[NAME_POLICY]
  # Per layer: the kernel's forward, and the output projection (its result
  # feeds tanh, whose derivative needs it; nothing names it).
  width = HEADS * kind.head_dim
  out_projection = 2 * BATCH * kind.seq * width * width
  assert report.recompute_flops == LAYERS * (_kernel_flops(kind) + out_projection)
  assert report.kernel_recompute_flops == LAYERS * _kernel_flops(kind)


# ------------------------------------------------------------ re-runs

@pytest.mark.parametrize("name", KIND_IDS)
@pytest.mark.parametrize("policy", ["save-everything", NAME_POLICY,
                                    "save-matmuls", KEEP_KERNEL],
                         ids=["save-everything", NAME_POLICY, "save-matmuls",
                              "keep-kernel"])
def test_recomputed_kernels_are_the_ones_jax_runs_again(name, policy,
                                                        remat_mode):
  kind = _kind(name)
  report = _compared(name, remat_mode).reports[getattr(policy, "name", policy)]
  if not _expected_reruns(kind, policy, remat_mode):
    assert report.recomputed_kernels == ()
    assert not any("runs the forward of" in w for w in report.warnings)
    return
  found = sorted(report.recomputed_kernels, key=lambda k: k.module_path)
  assert [k.kernel for k in found] == [kind.kernel] * LAYERS
  assert [k.module_path.split("/")[0] for k in found] == ["layers_0", "layers_1"]
  assert [k.runs for k in found] == [1.0] * LAYERS
  assert [k.flops for k in found] == [_kernel_flops(kind)] * LAYERS
  warning = next(w for w in report.warnings if "runs the forward of" in w)
  assert "tag_residuals" in warning and "residual_checkpoint_name" in warning


def _jaxprs_in(value):
  """Jaxprs held by an equation parameter, also inside the primitive objects
  JAX's hijax calls (remat3 regions, checkpoint names) carry."""
  if isinstance(value, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
    yield getattr(value, "jaxpr", value)
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _jaxprs_in(v)
  elif isinstance(getattr(value, "params", None), dict):
    for v in value.params.values():
      yield from _jaxprs_in(v)


def _pallas_calls(jaxpr) -> int:
  """``pallas_call`` equations run by ``jaxpr``, nested jaxprs included."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "pallas_call"
    for value in eqn.params.values():
      count += sum(_pallas_calls(j) for j in _jaxprs_in(value))
  return count


@pytest.mark.parametrize("policy", ["save-everything", NAME_POLICY])
def test_pallas_mha_runs_as_many_pallas_calls_as_reported(policy, remat_mode):
  _kind("pallas_gpu_mha")
  loss, params, x = _model(BY_NAME["pallas_gpu_mha"])

  def under(*a):
    with rt.use_policy(policy):
      return loss(*a)

  with jax_remat3(remat_mode):
    closed = jax.make_jaxpr(jax.grad(under))(params, x)
  # remat3 leaves dead recomputation in the program (XLA drops it).
  live = without_dead_code(closed.jaxpr)
  report = _compared("pallas_gpu_mha", remat_mode).reports[policy]
  reruns = sum(k.runs for k in report.recomputed_kernels)
  # Per layer: the forward, the backward's preprocessing and backward
  # kernels; a name policy adds the forward again (8 instead of 6).
  assert _pallas_calls(live) == 3 * LAYERS + reruns
  if policy == NAME_POLICY:
    assert _pallas_calls(live) == 8


def test_a_kernel_run_again_is_said_and_warned_with_the_fix():
  _kind("blockwise")
  loss, params, x = _model(BY_NAME["blockwise"])
  with jax_remat3(False), pytest.warns(
      UserWarning, match="runs the forward of kernel 'flash'") as caught:
    report = rt.analyze(loss, params, x, policy=NAME_POLICY)
  message = next(str(w.message) for w in caught
                 if "runs the forward" in str(w.message))
  assert "layers_0, layers_1" in message and "tag_residuals" in message
  text = str(report)
  assert "kernels whose forward runs again in the backward pass: flash at " \
         "layers_0 (1x" in text
  assert "kernel" in report.table().splitlines()[0]
  data = json.loads(report.to_json())
  assert data["recomputed_kernels"] == [
      {"kernel": "flash", "module_path": f"layers_{i}",
       "flops": _kernel_flops(BY_NAME["blockwise"]), "runs": 1.0}
      for i in range(LAYERS)]
  assert {r["kernel"] for r in data["residuals"]} == {None, "flash"}
  assert "forward runs again" in report._repr_html_()


def test_verify_and_breakdown_say_what_the_report_finds_about_kernels():
  # rt.verify checks gradients and rt.memory_breakdown splits memory; a
  # kernel the policy runs again is still the report's finding, and neither
  # drops it.
  _kind("blockwise")
  loss, params, x = _model(BY_NAME["blockwise"])
  with jax_remat3(False), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rerun = rt.verify(loss, params, x, policy=NAME_POLICY, check_values=False)
    kept = rt.verify(loss, params, x, policy="save-everything",
                     check_values=False)
    split = rt.memory_breakdown(loss, params, x, policy=NAME_POLICY)
  said = [w for w in rerun.warnings if "runs the forward of kernel 'flash'" in w]
  assert len(said) == 1 and said[0].kind == "kernel-rerun"
  assert "runs the forward of kernel" in str(rerun)
  assert not [w for w in kept.warnings if "runs the forward" in w]
  assert [w.kind for w in split.warnings
          if "runs the forward of kernel 'flash'" in w] == ["kernel-rerun"]


def test_compare_shows_the_kernels_each_policy_runs_again():
  _kind("pallas_gpu_mha")
  comparison = _compared("pallas_gpu_mha", False)
  rows = {row["policy"]: row for row in comparison.rows()}
  assert rows["save-everything"]["recomputed_kernels"] == []
  assert rows[NAME_POLICY]["recomputed_kernels"] == ["mha at layers_0",
                                                     "mha at layers_1"]
  text = str(comparison)
  assert "kernels re-run" in text.splitlines()[0]
  assert any(line.startswith(NAME_POLICY) and "mha 2x" in line
             for line in text.splitlines())
  assert any(f"policy {NAME_POLICY!r} runs the forward of kernel 'mha'" in w
             for w in comparison.warnings)


# ------------------------------------------------------------ remat modes

@pytest.mark.parametrize("name,policy", [
    ("blockwise_named", KEEP_KERNEL), ("splash_named", KEEP_KERNEL),
    ("blockwise", "save-matmuls")], ids=["names", "splash-names", "matmuls"])
def test_modes_that_keep_a_custom_vjp_differently_say_so(name, policy,
                                                        remat_mode):
  kind = _kind(name)
  reports = {mode: _compared(name, mode).reports[getattr(policy, "name", policy)]
             for mode in (False, True)}
  differ = reports[False].activation_bytes != reports[True].activation_bytes
  warned = [w for w in reports[remat_mode].warnings
            if "so the two remat modes keep different residuals" in w]
  # The modes disagree exactly where remat3 treats the kernel as opaque.
  assert differ is (not remat3_sees_into_custom_vjp())
  assert bool(warned) is differ
  if warned:
    assert custom_vjp_alignment() in warned[0]
    assert repr(kind.kernel) in warned[0]


@pytest.mark.parametrize("name", ["blockwise_named", "splash_named"])
def test_policies_that_keep_nothing_of_the_kernel_get_no_mode_finding(name):
  """A kernel whose forward names its residuals: the mode finding goes to
  the policies that select those names or matmuls, never to one that keeps
  nothing of the kernel (``boundary-only``, which keeps the same in both)."""
  _kind(name)
  reports = {mode: _compared(name, mode).reports for mode in (False, True)}
  for mode in (False, True):
    assert not any("remat modes" in w
                   for w in reports[mode]["boundary-only"].warnings), mode
  assert (reports[False]["boundary-only"].activation_bytes
          == reports[True]["boundary-only"].activation_bytes)
  kept = any("remat modes" in w
             for w in reports[True][KEEP_KERNEL.name].warnings)
  assert kept is (not remat3_sees_into_custom_vjp())


def test_jax_custom_vjp3_aligns_the_modes_where_this_jax_honours_it():
  _kind("blockwise_named")
  if not (has_custom_vjp3_flag()
          and remat3_sees_into_custom_vjp(True)):
    pytest.skip("jax_custom_vjp3 does not let remat3 see inside a custom_vjp "
                "on this JAX (the warning says jax_remat3=False instead)")
  loss, params, x = _model(BY_NAME["blockwise_named"])
  before = custom_vjp3_enabled()
  jax.config.update("jax_custom_vjp3", True)
  try:
    found = {}
    for mode in (False, True):
      with jax_remat3(mode), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = rt.analyze(loss, params, x, policy=KEEP_KERNEL)
        found[mode] = report
        assert report.activation_bytes == jax_activation_bytes(
            loss, (params, x), KEEP_KERNEL)
  finally:
    jax.config.update("jax_custom_vjp3", before)
  assert found[True].activation_bytes == found[False].activation_bytes
  kept = {mode: {r.name for r in found[mode].activations if r.kernel == "flash"}
          for mode in found}
  assert kept[True] == kept[False] == {"attn.context", "kernel.out", "kernel.lse"}
  assert not any("two remat modes" in w for w in found[True].warnings)


# ------------------------------------------------------------ matmul policies

def size_text(n: int) -> str:
  """A size as the toolkit writes it: binary units, one decimal above bytes."""
  for unit in ("B", "KiB", "MiB"):
    if n < 1024:
      return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"


def _activation_matmul_bytes(kind: Kind) -> int:
  """Bytes of the attention matmuls a matmul policy keeps in the model."""
  b, n, t, d = BATCH, HEADS, kind.seq, kind.head_dim
  # Per layer, in f32: the logits [B, N, T, S], and probabilities @ values
  # [B, N, T, D] once (dot_product_attention) or once per key block, stacked
  # (the scan kernel, blocks of 8 keys).
  blocks = t // 8 if kind.name.startswith("blockwise") else 1
  return LAYERS * 4 * (b * n * t * t + blocks * b * n * t * d)


@pytest.mark.parametrize("name", ["dot_product_xla", "blockwise"])
def test_matmul_policies_keeping_s_by_s_logits_say_so_with_the_bytes(name):
  kind = _kind(name)
  report = _compared(name, False).reports["save-matmuls"]
  warned = [w for w in report.warnings
            if "between two activations" in w]
  assert len(warned) == 1
  assert f", {size_text(_activation_matmul_bytes(kind))} of its" in warned[0]
  # The projections (a parameter among the operands) are not among them.
  assert "keeps the outputs of 4 matmuls" in warned[0]


@pytest.mark.parametrize("name", ["dot_product_xla", "blockwise", "pallas_gpu_mha"])
@pytest.mark.parametrize("policy", ["save-matmuls-no-batch", NAME_POLICY,
                                    "save-everything"])
def test_policies_that_keep_no_attention_matmul_do_not_say_so(name, policy):
  _kind(name)
  report = _compared(name, False).reports[policy]
  assert not any("between two activations" in w for w in report.warnings)


def test_projections_by_cast_or_transposed_weights_are_no_activation_matmuls():
  t, e = 16, 8

  @rt.remat
  def attend(w, x):
    wb = w.astype(jnp.bfloat16)  # mixed precision: still the parameter
    q, k, v = x @ wb[0].T, x @ wb[1], x @ wb[2]
    probs = jax.nn.softmax(q @ k.T)
    return jnp.sin(probs @ v).astype(jnp.float32)  # sin' needs its input

  args = (S((3, e, e), jnp.float32), S((t, e), jnp.bfloat16))
  with jax_remat3(False), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = rt.analyze(lambda w, x: attend(w, x).sum(), *args,
                        policy="save-matmuls")
  warned = [w for w in report.warnings
            if "between two activations" in w]
  # The logits [T, T] and probabilities @ values [T, E], in bfloat16; not
  # the three projections.
  assert len(warned) == 1 and "keeps the outputs of 2 matmuls" in warned[0]
  assert f", {size_text(2 * (t * t + t * e))} of its" in warned[0]
