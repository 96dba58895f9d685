"""Layer 10, the ``remat-toolkit`` command: options, verbs and output.

Imports every layer below; nothing imports it but the entry point.
"""
