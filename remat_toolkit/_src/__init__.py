"""The implementation of remat-toolkit; import from ``remat_toolkit``."""
