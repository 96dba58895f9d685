"""Shared test fixtures.

``remat_mode`` runs a test under both of JAX's remat implementations, the way
JAX's own remat tests re-run their classes with ``jax_remat3`` on.
"""

import os

import jax
import pytest

from remat_toolkit import _jax_internals as internals

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(params=[False, True], ids=["remat2", "remat3"])
def remat_mode(request):
  """Runs the test with jax_remat3 off, then on; yields the flag value."""
  with internals.remat3(request.param):
    yield request.param


@pytest.fixture(autouse=True)
def _isolated_policy_env(monkeypatch):
  monkeypatch.delenv("REMAT_TOOLKIT_POLICY_PATH", raising=False)
  yield
