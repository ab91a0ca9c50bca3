"""feed.h's device records as numpy dtypes, for tests that read or write them directly."""

import numpy as np

import metrale_feed as mf

# mf_select_row: one row's state between a split row's filter stages.
SELECT_ROW = np.dtype([("floor", "<u8"), ("cut_need", "<u8"), ("top_bits", "<u4"), ("cut_key", "<u4"),
                       ("prefix", "<u4"), ("shift", "<u4"), ("flags", "<u4"), ("list_len", "<u4"),
                       ("draft_bits", "<u4"), ("pad_", "<u4")])
assert SELECT_ROW.itemsize == mf._core.SELECT_ROW_BYTES
