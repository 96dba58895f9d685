"""Shared test fixtures (shared helper functions are in ``shared_helpers.py``).

``remat_mode`` runs a test under both of JAX's remat implementations, the way
JAX's own remat tests re-run their classes with ``jax_remat3`` on.
``quick_compiles`` turns XLA's optimisation passes off for a module of tiny
programs (``pytestmark = pytest.mark.usefixtures("quick_compiles")``);
``third_party_code`` allows the NumPy rank promotion that Hugging Face's
models rely on; ``fresh_catalogue`` gives a test the built-in policies alone
(the root ``conftest.py`` already restores the catalogue after every test);
``fresh_trace_warnings`` makes the findings a region raises once per process
when traced raise again, as in a fresh process.
Where tests may reach below the public API, and why: ``shared_helpers.py``.
"""


import jax
import pytest

from remat_toolkit._src.core import compat
from remat_toolkit._src.policies import catalog
from remat_toolkit._src.policies import findings

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
  """Marks tests that run under both remat modes themselves as both_modes.

  They do the same whatever ``JAX_REMAT3`` says, so CI's second pass
  (``JAX_REMAT3=1 -m "not both_modes and not pins_mode and not slow"``)
  leaves them out, as it leaves out the tests marked ``pins_mode`` by hand
  (each sets one mode around all it checks). A test cannot be both: one
  that takes ``remat_mode`` runs in each mode, and pinning it would be wrong.
  """
  del config
  for item in items:
    both = "remat_mode" in getattr(item, "fixturenames", ())
    if both and item.get_closest_marker("pins_mode") is not None:
      raise pytest.UsageError(
          f"{item.nodeid} takes the remat_mode fixture and is marked "
          "pins_mode: drop the mark (the fixture runs it in both modes).")
    if both:
      item.add_marker(pytest.mark.both_modes)


@pytest.fixture(params=[False, True], ids=["remat2", "remat3"])
def remat_mode(request):
  """Runs the test with jax_remat3 off, then on; yields the flag value."""
  with compat.remat3(request.param):
    yield request.param


@pytest.fixture
def fresh_catalogue():
  """The catalogue holds the built-ins alone: nothing registered or loaded."""
  with catalog.isolated(fresh=True):
    yield


@pytest.fixture
def fresh_trace_warnings():
  """Trace-time findings raised by earlier tests are raised again."""
  findings.forget_trace_warnings()
  yield


@pytest.fixture
def third_party_code():
  """Their code relies on NumPy rank promotion, which this suite forbids."""
  with jax.numpy_rank_promotion("allow"):
    yield


@pytest.fixture(scope="module")
def quick_compiles():
  """These programs are tiny: XLA's optimisation passes cost more than they save."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", before)
