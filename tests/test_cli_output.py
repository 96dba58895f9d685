"""White-box: the one output helper every command ends with.

``emit`` prints a result as text under its heading, or as JSON with
``--json``; warnings go into the JSON where it has a place for them and to
stderr where it has none (a list of records). No command's result is a list
with warnings today, so that branch has no public face: it is checked here
with a stand-in result, through the module's ``__all__``.
"""

import argparse
import json

import pytest

from remat_toolkit._src.cli.shared import emit


class _Result:
  """A stand-in result: JSON of the given shape, and two warnings."""

  warnings = ("first", "second")

  def __init__(self, data):
    self.data = data

  def to_json(self, **kwargs):
    return json.dumps(self.data, **kwargs)

  def __str__(self):
    return "as text"


@pytest.mark.parametrize("data,on_stderr", [
    ([{"policy": "x"}], 2),  # records: no place for the warnings
    ({"policy": "x", "warnings": ["first", "second"]}, 0),
])
def test_emit_sends_warnings_json_cannot_hold_to_stderr(capsys, data,
                                                        on_stderr):
  args = argparse.Namespace(json=True)
  assert emit(_Result(data), args, heading="model m", status=1) == 1
  out, err = capsys.readouterr()
  assert json.loads(out) == data
  assert err.count("remat-toolkit: warning: ") == on_stderr


def test_emit_prints_text_under_its_heading(capsys):
  args = argparse.Namespace(json=False)
  assert emit(_Result([]), args, heading="model m") == 0
  assert capsys.readouterr() == ("model m\nas text\n", "")


