"""Torch re-implementations of the model and of every score, for parity tests (needs torch)."""
