"""White-box: how many layers each remat region of a chain or scan takes.

``group_size`` turns ``group=`` (a number or ``"sqrt"``) into layers per
region, for ``rt.remat_chain`` (the last region may be shorter) and
``rt.scan_layers`` (``exact``: every region the same size). A pure function:
checked here over many layer counts, through the module's ``__all__``;
``test_grouping.py`` checks the regions the two make.
"""

import pytest

from remat_toolkit._src.transform.grouping import group_size


@pytest.mark.parametrize("group, layers, expected", [
    (1, 5, 1), (3, 5, 3), (5, 5, 5), ("sqrt", 24, 4), ("sqrt", 12, 3),
    ("sqrt", 4, 2), ("sqrt", 1, 1), ("sqrt", 48, 6), ("sqrt", 13, 4)])
def test_group_size(group, layers, expected):
  assert group_size(group, layers) == expected


def test_group_size_exact_sqrt_divides():
  assert group_size("sqrt", 13, exact=True) == 1
  assert group_size("sqrt", 24, exact=True) == 4


@pytest.mark.parametrize("group", [0, -2, True, 2.0, "half", None])
def test_bad_group_is_a_value_error(group):
  with pytest.raises(ValueError, match="group"):
    group_size(group, 4)


def test_group_larger_than_layers_or_not_dividing():
  with pytest.raises(ValueError, match="larger than the 4 layers"):
    group_size(5, 4)
  with pytest.raises(ValueError, match=r"does not divide .* \[1, 2, 4\]"):
    group_size(3, 4, exact=True)
