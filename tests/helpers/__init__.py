"""Helpers shared by the metrale_feed tests (importable as ``helpers`` from any test module)."""
