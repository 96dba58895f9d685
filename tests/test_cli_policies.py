"""``remat-toolkit list`` and ``show``, and what every command shares:
``--policy-file``, ``POLICY`` arguments and ``--json``."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from shared_helpers import policy_sources
from shared_helpers import remat3_offloads
from shared_helpers import run_cli

import remat_toolkit as rt
from remat_toolkit import models


def _run(capsys, *argv):
  del capsys  # run_cli captures the command's output itself
  return run_cli(*argv)


# ------------------------------------------------------------ list


def test_list_prints_a_row_per_policy(capsys):
  status, out, err = _run(capsys, "list", "--width", "160")
  assert status == 0 and err == ""
  lines = out.splitlines()
  assert lines[0].split() == ["name", "keeps", "offloads", "trade-off",
                              "aliases"]
  starts = [line.split()[0] for line in lines[2:]
            if line and not line.startswith(" ")]
  assert starts[:len(rt.list_policies())] == rt.list_policies()
  assert f"{len(rt.list_policies())} policies." in out


def test_list_rows_say_what_each_policy_keeps(capsys):
  _, out, _ = _run(capsys, "list", "--width", "200")
  rows = {line.split()[0]: line for line in out.splitlines()
          if line and not line.startswith(" ")}
  assert "region inputs only" in rows["boundary-only"]
  assert "full, save_nothing" in rows["boundary-only"]
  assert "everything" in rows["save-everything"]
  assert "every matmul output" in rows["save-matmuls"]
  assert "attn.q, attn.k, attn.v" in rows["save-qkv"]
  assert "save_qkv_proj" in rows["save-qkv"]
  assert "attn.q" in rows["offload-qkv"].split("region inputs only")[1]


@pytest.mark.parametrize("width", [140, 200])
def test_list_fits_the_width_and_wraps_descriptions(capsys, width):
  _, out, _ = _run(capsys, "list", "--width", str(width))
  table = out.split("\n\n" + str(len(rt.list_policies())))[0]
  assert max(len(line) for line in table.splitlines()) <= width
  # Every word of a long description is still printed, wrapped.
  words = rt.get_policy("boundary-only").description.split()
  assert all(word in out for word in words)


def test_list_json(capsys):
  status, out, _ = _run(capsys, "list", "--json")
  assert status == 0
  records = json.loads(out)
  assert [r["name"] for r in records] == rt.list_policies()
  by_name = {r["name"]: r for r in records}
  qkv = by_name["save-qkv"]
  assert qkv["aliases"] == ["save_qkv_proj"]
  assert tuple(qkv["save"]) == rt.get_policy("save-qkv").save
  assert qkv["lowers_to"] == rt.get_policy("save-qkv").describe_lowering()
  assert qkv["runs_under_remat3"] is True
  assert (by_name["offload-qkv"]["runs_under_remat3"]
          is remat3_offloads())
  assert Path(qkv["source"]).name == "save-qkv.toml"


def test_list_includes_user_policies(capsys, tmp_path, fresh_catalogue):
  path = tmp_path / "mine.toml"
  path.write_text('name = "keep-up"\nsave = ["ffn.up"]\n'
                  'description = "Mine."\n')
  status, out, _ = _run(capsys, "list", "--json", "--policy-file", str(path))
  assert status == 0
  mine = [r for r in json.loads(out) if r["name"] == "keep-up"]
  assert mine and mine[0]["source"] == str(path)


# ------------------------------------------------------------ show


def test_show_minimal(capsys):
  status, out, err = _run(capsys, "show", "minimal")
  assert status == 0 and err == ""
  policy = rt.get_policy("minimal")
  lines = out.splitlines()
  assert lines[0] == "save-projections  (aliases: minimal)"
  assert policy_sources()["save-projections"].endswith("save-projections.toml")
  assert policy_sources()["save-projections"] in out
  assert "matmuls         none" in out
  flat = " ".join(out.split())
  assert " ".join(policy.describe_lowering().split()) in flat
  assert "jax.checkpoint_policies.save_only_these_names(" in out
  assert "behaves the same with jax_remat3 off and on" in flat
  assert all(name in flat for name in policy.save)


def test_show_an_offload_policy_says_whether_it_runs_under_remat3(capsys):
  _, out, _ = _run(capsys, "show", "minimal_offloaded")
  flat = " ".join(out.split())
  if remat3_offloads():
    assert "behaves the same with jax_remat3 off and on" in flat
  else:
    assert f"CANNOT run under jax {jax.__version__}'s jax_remat3" in flat
  assert "save_and_offload_only_these_names(" in flat
  assert "offload_dst='pinned_host'" in flat


def test_show_patterns_explains_expansion(capsys):
  _, out, _ = _run(capsys, "show", "save-ffn")
  flat = " ".join(out.split())
  assert "*mlp/*" in flat
  assert "glob patterns expanded" in flat


def test_show_json(capsys):
  status, out, _ = _run(capsys, "show", "SAVE_DOT_ONLY", "--json")
  record = json.loads(out)
  assert status == 0
  assert record["name"] == "save-matmuls"
  assert record["lowers_to"] == "jax.checkpoint_policies.dots_saveable"


def test_show_a_policy_file(capsys, tmp_path):
  path = tmp_path / "mine.toml"
  path.write_text('name = "keep-up"\nsave = ["ffn.up"]\n')
  status, out, _ = _run(capsys, "show", str(path))
  assert status == 0
  assert out.splitlines()[0] == "keep-up"
  assert "save_only_these_names('ffn.up')" in out
  assert "keep-up" not in rt.list_policies()  # checked, not registered


# ------------------------------------------------------------ --policy-file


def _write_policy(folder, name, save="ffn.up"):
  path = folder / f"{name}.toml"
  path.write_text(f'name = "{name}"\nsave = ["{save}"]\n')
  return path


def test_policy_file_is_repeatable_and_takes_folders(capsys, tmp_path,
                                                     fresh_catalogue):
  one = _write_policy(tmp_path, "keep-up")
  folder = tmp_path / "more"
  folder.mkdir()
  _write_policy(folder, "keep-down", save="ffn.down")
  status, out, err = _run(capsys, "list", "--json", "--policy-file", str(one),
                          "--policy-file", str(folder))
  assert status == 0 and err == ""
  names = [r["name"] for r in json.loads(out)]
  assert {"keep-up", "keep-down"} <= set(names)


def test_the_removed_policies_spelling_is_refused(capsys, tmp_path):
  path = _write_policy(tmp_path, "keep-up")
  status, _, err = _run(capsys, "list", "--policies", str(path))
  assert status == 2 and "unrecognized arguments: --policies" in err


def test_help_names_policy_file():
  status, out, _ = run_cli("compare", "--help")
  assert status == 0
  flat = " ".join(out.split())
  assert "--policy-file PATH" in flat
  assert "--policies" not in flat
  assert "[POLICY ...]" in flat and "--policy POLICY" in flat


def test_many_policy_commands_take_policy_too():
  # Not read as an abbreviation of --policy-file, which would look for a
  # file of that name.
  status, out, err = run_cli("compare", "save-ffn", "--policy", "save-qkv",
                             "--model", "tiny", "--json")
  assert status == 0, err
  assert [r["policy"] for r in json.loads(out)["rows"]] == ["save-ffn", "save-qkv"]
  # bench compiles for seconds: a misspelt name shows how it was read.
  status, _, err = run_cli("bench", "--policy", "save-atention", "--quiet")
  assert status == 2
  assert "Unknown remat policy 'save-atention'" in err
  assert "does not exist" not in err


def test_a_policy_file_is_a_policy_name_everywhere(capsys, tmp_path):
  path = _write_policy(tmp_path, "keep-up")
  status, out, _ = _run(capsys, "analyze", "--model", "tiny", "--policy",
                        str(path), "--json")
  assert status == 0
  assert json.loads(out)["policy"] == "keep-up"
  assert "keep-up" not in rt.list_policies()  # run, not registered


@pytest.mark.slow
def test_peak_takes_one_policy_either_way_and_compare_adds_peaks():
  loss_fn, loss_args = models.build_loss("tiny")
  expected = {name: rt.peak(loss_fn, *loss_args, policy=name).bytes
              for name in ("boundary-only", "save-ffn")}
  for argv, name in ((["save-ffn"], "save-ffn"),
                     (["--policy", "save-ffn"], "save-ffn"),
                     ([], "boundary-only")):  # the ambient default
    status, out, err = run_cli("peak", *argv, "--model", "tiny", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert (data["policy"], data["bytes"]) == (name, expected[name])
  status, out, err = run_cli("compare", "boundary-only", "save-ffn", "--model",
                             "tiny", "--peak", "--json")
  assert status == 0, err
  assert {r["policy"]: r["peak_bytes"] for r in json.loads(out)["rows"]} == (
      expected)


@pytest.mark.slow
def test_plan_bounds_the_peak_from_the_command_line():
  """``plan --bounds peak [--optimizer]`` is rt.plan(bounds="peak"): the same
  policy and predicted peak; the peak options alone are refused as the API
  refuses them."""
  loss_fn, loss_args = models.build_loss("tiny")
  budget = rt.peak(loss_fn, *loss_args, policy="save-ffn",
                   optimizer="adamw").bytes
  expected = rt.plan(loss_fn, *loss_args, budget=budget, bounds="peak",
                     optimizer="adamw")
  status, out, err = run_cli("plan", "--model", "tiny", "--budget",
                             str(budget), "--bounds", "peak", "--optimizer",
                             "adamw", "--json")
  assert status == 0, err
  data = json.loads(out)
  assert (data["bounds"], data["peak_bytes"]) == ("peak", expected.peak_bytes)
  assert data["peak_bytes"] <= budget
  assert data["recompute_flops"] == expected.recompute_flops
  for extra in (["--compile"], ["--optimizer", "adamw"]):
    status, out, err = run_cli("plan", "--model", "tiny", "--budget", "1MiB",
                               *extra)
    assert status == 2 and out == "" and err.count("\n") == 1, extra
    assert "needs bounds='peak'" in err and "Traceback" not in err


# ------------------------------------------------------------ --json

# bench's --json (it runs steps: seconds) is tested in test_bench.py.
_JSON_COMMANDS = {
    "list": ["list"],
    "show": ["show", "save-ffn"],
    "compare": ["compare", "boundary-only", "save-ffn", "--model", "tiny"],
    "analyze": ["analyze", "--policy", "save-ffn", "--model", "tiny"],
    "breakdown": ["breakdown", "--model", "tiny", "--optimizer", "adamw"],
    "peak": ["peak", "save-ffn", "--model", "tiny"],
    "verify": ["verify", "--policy", "save-ffn", "--no-values"],
    "plan": ["plan", "--model", "tiny", "--budget", "400KiB",
             "--max-evaluations", "4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(_JSON_COMMANDS))
def test_every_command_prints_json(capsys, command):
  status, out, _ = _run(capsys, *_JSON_COMMANDS[command], "--json")
  assert status == 0
  assert isinstance(json.loads(out), (dict, list))


def test_every_command_with_results_has_json():
  _, out, _ = run_cli("--help")
  commands = re.findall(r"^    (\w+)", out.split("COMMAND", 2)[2], re.M)
  assert set(commands) == {*_JSON_COMMANDS, "bench"}
  for name in commands:
    status, out, _ = run_cli(name, "--help")
    assert status == 0 and "--json" in out, name


# ------------------------------------------------------------ user errors


def test_unknown_name_exits_2_with_one_line(capsys):
  status, out, err = _run(capsys, "show", "save-atention")
  assert status == 2 and out == ""
  assert err.count("\n") == 1
  assert err.startswith("remat-toolkit: error: Unknown remat policy "
                        "'save-atention'. Did you mean 'save-attention'")
  assert "Traceback" not in err


def test_bad_policy_file_exits_2_naming_file_and_key(capsys, tmp_path):
  path = tmp_path / "bad.toml"
  path.write_text('name = "x"\nmatmuls = "most"\n')
  for argv in (["show", str(path)], ["list", "--policy-file", str(path)]):
    status, out, err = _run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1
    assert f"{path}: Policy.matmuls must be one of" in err


def test_missing_policy_file_exits_2(capsys, tmp_path):
  status, _, err = _run(capsys, "show", str(tmp_path / "nope.toml"))
  assert status == 2
  assert "nope.toml" in err and "does not exist" in err


def test_usage_errors_exit_2():
  for argv in ([], ["frobnicate"], ["show"]):
    status, _, err = run_cli(*argv)
    assert status == 2, argv
    assert "usage: remat-toolkit" in err, argv


def test_help_exits_0():
  status, out, _ = run_cli("--help")
  assert status == 0
  assert "list" in out and "show" in out


# ------------------------------------------------------------ entry points


def _console_script():
  bindir = Path(sys.executable).parent
  found = shutil.which("remat-toolkit", path=str(bindir))
  if found is None:
    pytest.fail(f"no remat-toolkit script next to {sys.executable}; "
                "install the package: pip install -e '.[test]'")
  return found


def _subprocess_env():
  env = dict(os.environ)
  env.pop("REMAT_TOOLKIT_POLICY_PATH", None)
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.mark.slow
def test_installed_console_script_lists_the_catalogue():
  result = subprocess.run([_console_script(), "list"], capture_output=True,
                          text=True, timeout=120, env=_subprocess_env())
  assert result.returncode == 0, result.stderr
  for name in rt.list_policies():
    assert f"\n{name} " in result.stdout


@pytest.mark.slow
def test_python_dash_m_and_exit_status():
  result = subprocess.run(
      [sys.executable, "-m", "remat_toolkit", "show", "no-such-policy"],
      capture_output=True, text=True, timeout=120, env=_subprocess_env())
  assert result.returncode == 2
  assert result.stdout == ""
  assert result.stderr.startswith("remat-toolkit: error: Unknown remat policy")
  assert "Traceback" not in result.stderr
