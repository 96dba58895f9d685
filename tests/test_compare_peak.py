"""``rt.compare(..., peak=True)``: each policy's step peak beside what it keeps,
the same figures ``rt.peak`` gives, and the chart with the peak on its axis."""

import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from shared_helpers import xla_step_bytes

import remat_toolkit as rt


@rt.remat
def _layer(w, x):
  return jnp.tanh(rt.tag(x @ w, "ffn.up"))


def loss(w, x):
  return _layer(w, _layer(w, x)).sum()


ARGS = (jax.ShapeDtypeStruct((64, 64), jnp.float32),
        jax.ShapeDtypeStruct((32, 64), jnp.float32))
POLICIES = ["boundary-only", "save-ffn", "save-everything"]


def _quietly(make):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # XLA:CPU's scheduler, prediction error
    return make()


@pytest.fixture(scope="module")
def compared():
  return _quietly(lambda: rt.compare(loss, *ARGS, policies=POLICIES,
                                     peak=True))


def test_each_policy_peaks_as_rt_peak_says(compared):
  assert list(compared.peaks) == POLICIES
  for name in POLICIES:
    alone = _quietly(lambda n=name: rt.peak(loss, *ARGS, policy=n))
    assert compared.peaks[name].bytes == alone.bytes, name
    assert compared.peaks[name].kept_bytes == alone.kept_bytes, name
    assert compared.peaks[name].xla_bytes is None
  rows = {r["policy"]: r for r in compared.rows()}
  assert {n: r["peak_bytes"] for n, r in rows.items()} == {
      n: p.bytes for n, p in compared.peaks.items()}
  assert all("xla_peak_bytes" not in r for r in rows.values())
  text = str(compared)
  headers = text.splitlines()[0].split()
  assert headers.index("peak") == headers.index("offloaded") + 1
  assert "XLA peak" not in text
  data = json.loads(compared.to_json())
  assert data["peaks"]["save-ffn"] == {
      "bytes": compared.peaks["save-ffn"].bytes, "xla_bytes": None,
      "when": compared.peaks["save-ffn"].when}


def test_without_peak_nothing_changes():
  c = rt.compare(loss, *ARGS, policies=POLICIES)
  assert c.peaks is None
  assert all("peak_bytes" not in r for r in c.rows())
  assert "peaks" not in c.to_dict() and " peak " not in str(c)


def test_compiled_peaks_are_xla_figures_of_jit_grad():
  c = _quietly(lambda: rt.compare(loss, *ARGS, policies=POLICIES[:2],
                                  peak=True, compile=True))
  for row in c.rows():
    expected = xla_step_bytes(loss, ARGS, row["policy"])
    assert row["xla_peak_bytes"] == expected == c.peaks[row["policy"]].xla_bytes
  assert "XLA peak" in str(c) and "XLA peak" in c._repr_html_()
  # Each peak's findings are the comparison's too, once each.
  found = [w for p in c.peaks.values() for w in p.warnings]
  assert set(found) <= set(c.warnings)
  assert len(c.warnings) == len(set(c.warnings))


@pytest.fixture
def agg():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  yield
  plt.close("all")


def test_the_chart_puts_the_peak_on_its_memory_axis(agg, compared):
  ax = compared.plot(memory="peak")
  assert "peak" in ax.get_xlabel()
  drawn = sorted(float(x) for c in ax.collections for x, _ in c.get_offsets())
  assert drawn == pytest.approx(sorted(p.bytes / 2**20
                                       for p in compared.peaks.values()))
  kept = compared.plot()
  assert "kept" in kept.get_xlabel()
  drawn = sorted(float(x) for c in kept.collections for x, _ in c.get_offsets())
  assert drawn == pytest.approx(sorted(r["activation_bytes"] / 2**20
                                       for r in compared.rows()))


def test_the_peak_chart_needs_peaks(agg):
  c = rt.compare(loss, *ARGS, policies=POLICIES[:2])
  with pytest.raises(ValueError, match=r"rt\.compare\(\.\.\., peak=True\)"):
    c.plot(memory="peak")
  with pytest.raises(ValueError, match="'kept', 'peak'"):
    c.plot(memory="kep")
