"""Fixtures for every test and doctest (tests/ and the package's docstrings).

The policy catalogue is process-global: every test and every docstring example
that registers a policy gets the catalogue back as it found it.
"""

import pytest

from remat_toolkit._src.policies import catalog


@pytest.fixture(autouse=True)
def _isolated_policy_env(monkeypatch):
  monkeypatch.delenv("REMAT_TOOLKIT_POLICY_PATH", raising=False)
  yield


@pytest.fixture(autouse=True)
def restore_registry():
  """Each test and example gets the process-global catalogue back as it was."""
  with catalog.isolated():
    yield
