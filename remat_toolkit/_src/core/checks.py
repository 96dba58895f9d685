"""Checks of the arguments many verbs share, refused before anything is traced.

Example:
  >>> from remat_toolkit._src.core.checks import check_flag
  >>> check_flag("compile", True)
  >>> check_flag("compile", "yes")
  Traceback (most recent call last):
  ...
  TypeError: compile must be True or False, got 'yes'.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_flag"]


def check_flag(label: str, value: Any) -> None:
  """Refuses ``value`` unless it is True or False (``label`` names it): a
  string such as ``'no'`` is truthy, and would silently mean True."""
  if not isinstance(value, bool):
    raise TypeError(f"{label} must be True or False, got {value!r}.")
