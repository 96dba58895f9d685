"""Layer 7, planning: the least recompute that fits a memory budget.

Pure solvers (the plan search, the multiple-choice knapsack) apart from the
measurement (the planner, per-region plans, per-device figures, the
frontier). Imports the layers below.
"""
