"""``metrale_feed.reference``: the reference model's documented import path.

The model lives in :mod:`metrale_feed.testing.reference` with the other test doubles; this module
names the same objects, so ``from metrale_feed.reference import ReferenceModel`` keeps working.
"""

from .testing.reference import *  # noqa: F401,F403  (the public names, as __all__ lists them)
from .testing.reference import __all__ as __all__
