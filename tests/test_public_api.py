"""The public surface: small, documented with examples, one meaning per name."""

import importlib
import importlib.util
import inspect
import pkgutil

import pytest

import remat_toolkit as rt
from remat_toolkit import results

PUBLIC_MODULES = {"remat_toolkit.results", "remat_toolkit.names",
                  "remat_toolkit.models"}


def test_the_top_level_is_about_twenty_names():
  assert 18 <= len(rt.__all__) <= 28, rt.__all__
  assert len(set(rt.__all__)) == len(rt.__all__)
  for name in rt.__all__:
    assert hasattr(rt, name), name


def test_every_top_level_function_shows_a_runnable_example_in_help():
  missing = [name for name in rt.__all__
             if "Example" not in (inspect.getdoc(getattr(rt, name)) or "")]
  assert not missing, f"no Example: section in the docstring of {missing}"


def test_no_top_level_function_shadows_a_module():
  for name in rt.__all__:
    assert importlib.util.find_spec(f"remat_toolkit.{name}") is None, name


def test_implementation_modules_are_private():
  public = sorted(
      m.name for m in pkgutil.iter_modules(rt.__path__, "remat_toolkit.")
      if not m.name.rsplit(".", 1)[1].startswith("_"))
  assert set(public) == PUBLIC_MODULES


def test_result_classes_are_importable_from_remat_toolkit_results():
  for name in results.__all__:
    cls = getattr(results, name)
    assert inspect.isclass(cls), name
    assert cls.__name__ == name


RESULTS = ("ResidualReport", "Comparison", "Breakdown", "Plan", "Frontier",
           "Verification", "BenchResult", "BatchSearch", "RematSummary")


@pytest.mark.parametrize("name", RESULTS)
def test_every_result_is_data_with_one_protocol_and_its_renderers(name):
  """Results are data: each says what it holds (to_dict, hence to_json) and
  renders through the one rendering entry, which the display fills."""
  from remat_toolkit._src.results import base
  cls = getattr(results, name)
  assert issubclass(cls, base.Result)
  assert cls.to_dict is not base.Result.to_dict, f"{name} has no to_dict"
  assert cls.to_json is base.Result.to_json, f"{name} writes JSON its own way"
  for rendering in (base.to_text, base.to_html):
    assert cls in rendering.registry, f"{name} has no {rendering.__name__}"


@pytest.mark.parametrize("name", ["Plan", "ResidualReport", "Verification",
                                  "VOCABULARY", "MAXTEXT_NAMES"])
def test_names_that_left_the_top_level_are_gone(name):
  """0.2 removed the 0.1 spellings (``rt.Plan``...); each lives in
  :mod:`remat_toolkit.results` or :mod:`remat_toolkit.names`."""
  assert not hasattr(rt, name)


def test_an_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'Nope'"):
    rt.Nope  # noqa: B018


def test_the_version_is_the_installed_distributions():
  import importlib.metadata
  assert rt.__version__ == importlib.metadata.version("remat-toolkit")
