"""``PickStep``: one pick's launch, described once and handed down.

The Python mirror of the C layer's launch descriptors (``mf_argmax_args``, ``mf_verify_args``):
what a launch picks from (the logits and their layout, masks, bitmask, params, penalties, the
grammar) and where it writes (cells, ``dst``, the event, logprobs). The scheduler's router builds
one a launch and hands it to the model's ``pick_to_feed``, which completes it with its feed
(``PickStep.on``) and calls ``metrale_feed.pick_to_feed``; the speculative step builds its verify
(op ``"verify"``) and hands it to ``metrale_feed.pick_to_feed`` itself; ``argmax_to_feed``,
``sample_to_feed`` and ``verify_to_feed`` take keywords, as they always have, and build one; the
shard of a split vocabulary (``VocabShard.run_step``) runs one. Adding an option to a launch
adds a field, not a parameter to every function on the way down.

The type lives in the extension (``metrale_feed._core``), so that making one costs what passing
keywords did; this module names it where the layers above look for it.
"""

from __future__ import annotations

from ._core import PICK_FIELDS, PICK_OPS, PickStep, pick_to_feed

__all__ = ["PickStep", "OPS", "FIELDS", "pick_to_feed"]

#: The launches a ``PickStep`` describes.
OPS = PICK_OPS
#: Its fields, in order.
FIELDS = PICK_FIELDS
