"""Fixtures for every test and doctest (tests/ and the package's docstrings).

The policy catalogue is process-global: every test and every docstring example
that registers a policy gets the catalogue back as it found it.
"""

import pytest

from remat_toolkit._src import catalog


@pytest.fixture(autouse=True)
def _isolated_policy_env(monkeypatch):
  monkeypatch.delenv("REMAT_TOOLKIT_POLICY_PATH", raising=False)
  yield


@pytest.fixture(autouse=True)
def restore_registry():
  """Snapshots the process-global catalogue and puts it back afterwards."""
  reg = catalog._REGISTRY
  reg._ensure_loaded()
  saved = (dict(reg._policies), dict(reg._aliases), dict(reg._sources),
           reg._loaded_env, reg._builtins_loaded)
  yield
  with reg._lock:
    (policies, aliases, sources, reg._loaded_env,
     reg._builtins_loaded) = saved
    reg._policies, reg._aliases, reg._sources = (
        dict(policies), dict(aliases), dict(sources))
