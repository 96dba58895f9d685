"""White-box: how ``rt.remat_modules`` picks the blocks of a model it is given
no rules for.

``find_blocks`` reads only a model's module paths and classes, so the
heuristic is checked here on hand-made trees (a mixture of experts, two
stacks, gaps, leaves only) that would each take a model to build through the
public API; ``test_discovery.py`` checks it on real models.
"""

from remat_toolkit._src.transform.discovery import find_blocks


def paths(*names):
  return {tuple(name.split("/")) if name else (): cls for name, cls in names}


def test_find_blocks_heuristic():
  find = find_blocks
  # Blocks, not the repeated Dense inside them; the experts nested in a block
  # are part of its region.
  moe = paths(("", "Net"), ("Dense_0", "Dense"), ("Dense_1", "Dense"),
              *[(f"layers_{i}", "Block") for i in range(3)],
              *[(f"layers_{i}/experts_{j}", "Mlp") for i in range(3)
                for j in range(2)],
              *[(f"layers_{i}/experts_{j}/Dense_{k}", "Dense")
                for i in range(3) for j in range(2) for k in range(2)])
  assert find(moe) == [("layers_0",), ("layers_1",), ("layers_2",)]
  # Two stacks of different classes both count; consecutive indices only.
  two = paths(*[(f"vision/{i}/mlp", "Dense") for i in range(2)],
              *[(f"vision/{i}", "ViTBlock") for i in range(2)],
              *[(f"text/h_{i}/mlp", "Dense") for i in range(2)],
              *[(f"text/h_{i}", "GPTBlock") for i in range(2)],
              ("gapped/0/x", "Dense"), ("gapped/0", "B"),
              ("gapped/2/x", "Dense"), ("gapped/2", "B"))
  assert find(two) == [("vision", "0"), ("vision", "1"),
                       ("text", "h_0"), ("text", "h_1")]
  # Leaves only, or one block: nothing.
  assert find(paths(("Dense_0", "Dense"), ("Dense_1", "Dense"))) == []
  assert find(paths(("Block_0/Dense_0", "Dense"), ("Block_0", "B"))) == []
