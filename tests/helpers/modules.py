"""Importing a module from a file outside any package on the path: a tool script, an example, an
extension the test just compiled."""

from __future__ import annotations

import importlib.util


def load_file(name, path):
    """The module ``name``, executed from ``path`` (not put in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
