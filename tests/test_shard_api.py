"""VocabShard's checks that need no process group: a missing torch names the extra; bad
arguments are refused before torch or any collective is touched (tests/tp runs the ranks)."""

import pytest

from helpers.child import run_python

import metrale_feed as mf


def test_missing_torch_is_an_import_error_naming_the_extra():
    done = run_python("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import metrale_feed as mf
        try:
            mf.VocabShard(None, 1000)
        except ImportError as exc:
            print("refused:", exc)
    """, timeout=60)
    assert "refused:" in done.stdout and "metrale-feed[torch]" in done.stdout, done.describe()


@pytest.mark.parametrize("vocab, max_rows", [(0, 8), (mf.MAX_VOCAB + 1, 8), (100, 0),
                                             (100, mf.MAX_ROWS + 1), (100.0, 8), (True, 8)])
def test_bad_vocab_or_max_rows_is_refused_first(vocab, max_rows):
    with pytest.raises(ValueError):
        mf.VocabShard(None, vocab, max_rows=max_rows)


def test_importing_the_package_leaves_torch_out():
    done = run_python("""
        import sys, metrale_feed as mf
        mf.VocabShard  # the lazy name resolves without torch
        print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
    """, timeout=60)
    assert done.stdout.strip() == "[]", done.describe()
