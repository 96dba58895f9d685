"""Internal invariants with no public face, checked white-box.

Every other test checks behaviour through the public API. What is here is an
optimisation or an internal contract whose only visible effect is that the
public figures do not change, so a public test cannot tell it is in place:
each test says what it guards and why it cannot be seen from outside.
"""

from unittest import mock

import pytest
from shared_helpers import remat3
from shared_helpers import remat_bodies

import remat_toolkit as rt
from remat_toolkit import models
from remat_toolkit._src.analysis import trace
from remat_toolkit._src.core import jaxpr as _jaxpr

# ---------------------------------------------------------------- shared bodies

@pytest.mark.parametrize("framework, layer", [("linen", "layers_{}/attn"),
                                              ("nnx", "layers/{}/attn")])
def test_identical_layers_share_one_body_without_changing_the_report(
    framework, layer):
  """The analyzer makes identical unrolled layers one jaxpr, so analysing a
  policy costs one layer's work: only its speed shows, and the report must
  be the one an unshared trace gives."""
  fn, args = models.build_loss(models.get_config("tiny", num_layers=4),
                               scan=False, framework=framework)
  with remat3(False):  # remat3 re-traces regions itself: nothing is shared
    program = trace.TracedProgram(fn, args)
    bodies = {id(body) for body in remat_bodies(program.jaxpr.jaxpr)}
    assert program.regions == 4 and len(bodies) == 1
    shared = program.report(rt.get_policy("save-attention"))
    with mock.patch.object(_jaxpr, "share_identical_regions", lambda j, m: j):
      plain = trace.TracedProgram(fn, args).report(rt.get_policy("save-attention"))
  assert shared.to_dict() == plain.to_dict()
  assert {layer.format(i) for i in range(4)} <= {
      r.module_path for r in shared.activations}
