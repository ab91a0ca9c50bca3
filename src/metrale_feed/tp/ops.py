"""The extension's entry points for a split vocabulary: the one place this layer reaches into
``_core``'s private API, each a launcher of the C layer's (feed.h) that checks its arguments and
queues in stream order like the public ops.

======================  =====================================================================
``argmax_partial``      a slice's argmax records (``MF_ARGS_PARTIAL``), one block a call
``sample_partial``      a slice's race records for sampled rows
``select_partial``      a filter stage's records over a slice (``MF_ARGS_SELECT``)
``select_decide``       a filter round's decision from the gathered blocks (select_rule.h)
``combine_partials``    the cells (ids, logprobs) from the gathered blocks, with the fault word
``check_partials_fault`` a combine's fault word, read back, as a ``FeedError``
``verify_logit_params`` a verify's logit rows' params, written on the device
``top_block_bytes``     the bytes of a ``top_logprobs`` block of ``rows`` rows and ``n`` ids
``top_partial``         a slice's top logprobs block; ``top_combine`` merges the gathered ones
``device_bytes_left``   bytes of a device allocation from an address to its end
``sampling_plan``       the kernels' reading of params records (``PLAN_*`` bits a row)
``grammar_mask``        the bitmask rows of each row's grammar states (``mf_grammar_mask``)
``grammar_advance``     each row's grammar state advanced by the ids its pick wrote
======================  =====================================================================

The sizes and layouts of the blocks are the extension's constants (``_core.PARTIAL_*``,
``_core.SELECT_*``), read there from the C headers.
"""

from __future__ import annotations

from .. import _core

__all__ = ["argmax_partial", "sample_partial", "select_partial", "select_decide",
           "combine_partials", "check_partials_fault", "verify_logit_params", "top_block_bytes",
           "top_partial", "top_combine", "device_bytes_left", "sampling_plan", "grammar_mask",
           "grammar_advance", "PLAN_SAMPLED",
           "PLAN_TOP_K", "PLAN_TOP_P", "PLAN_MIN_P"]

argmax_partial = _core._argmax_partial
sample_partial = _core._sample_partial
select_partial = _core._select_partial
select_decide = _core._select_decide
combine_partials = _core._combine_partials
check_partials_fault = _core._check_partials_fault
verify_logit_params = _core._verify_logit_params
top_block_bytes = _core._top_block_bytes
top_partial = _core._top_partial
top_combine = _core._top_combine
device_bytes_left = _core._device_bytes_left
sampling_plan = _core._sampling_plan
grammar_mask = _core._grammar_mask
grammar_advance = _core._grammar_advance
PLAN_SAMPLED: int = _core._PLAN_SAMPLED
PLAN_TOP_K: int = _core._PLAN_TOP_K
PLAN_TOP_P: int = _core._PLAN_TOP_P
PLAN_MIN_P: int = _core._PLAN_MIN_P
