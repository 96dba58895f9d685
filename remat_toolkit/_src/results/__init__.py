"""Layer 3, results: what the toolkit's functions return, as data only.

Frozen data classes with ``to_dict``/``to_json``; they render as text, HTML
and DataFrames through functions that :mod:`~remat_toolkit._src.display`
registers, so no result imports the display. Imports the core and policies.
"""
