"""Soak: N router steps on the host backend (4 rows, vocab 64, block size 4), sequences restarted
when they reach 24 ids with their blocks returned, every token checked against the host
reference. Resident memory and ``live_objects()`` at 10% of the steps and at the end must be flat.

N is ``METRALE_FEED_SOAK_STEPS`` (default 20000, for CI); ``tools/soak.py`` is the same loop at
1,000,000 steps. The driver lives there so the README's figures and this test run the same code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import metrale_feed as mf

from helpers.modules import load_file

STEPS = int(os.environ.get("METRALE_FEED_SOAK_STEPS", "20000"))
# Fixed, not per step: after warm-up a correct loop allocates nothing that lives on. At 20000
# steps this catches a leak of about 50 bytes a step; the noise measured is tens of KiB. Under
# AddressSanitizer freed memory sits in its quarantine, so tools/sanitize.sh raises the bound.
RSS_BOUND = int(os.environ.get("METRALE_FEED_SOAK_RSS_BOUND", str(1 << 20)))


def load_soak():
    path = Path(__file__).resolve().parent.parent / "tools" / "soak.py"
    return load_file("metrale_feed_soak_tool", path)


@pytest.fixture(scope="module")
def soak_tool():
    return load_soak()


@pytest.mark.slow
def test_soak_is_flat(host, no_leaks, soak_tool):
    start_counts = mf.live_objects()
    soak = soak_tool.Soak(STEPS, rows=4, vocab=64, block_size=4, max_len=24, seed=1)
    result = soak.run()
    print()
    print(soak_tool.report(result))

    first, last = result["samples"]
    assert first["step"] == max(1, STEPS // 10) and last["step"] == STEPS
    assert result["checked"] == result["tokens"] > 3 * STEPS, "fewer tokens than rows x steps"
    assert result["restarts"] > STEPS // 20, "sequences did not restart: memory was not bounded"
    assert result["stats"]["rollbacks"] > 0, "no discarded step ahead was rolled back"
    # Flat: the same live objects, and resident memory within the bound.
    assert first["live"] == last["live"], "live objects grew during the soak"
    growth = last["rss"] - first["rss"]
    assert growth <= RSS_BOUND, f"RSS grew {growth / 1024:.0f} KiB between step {first['step']} and {last['step']}"
    # Bounded KV: at most the blocks of the rows in flight, and all of them back at the end.
    assert result["pool_free_at_end"] == result["num_blocks"]
    assert result["stats"]["reserved_in_flight"] == 0
    assert result["live_after_close"] == start_counts


def test_soak_driver_catches_a_wrong_token(host, no_leaks, soak_tool, monkeypatch):
    """The soak's check can fail: a host reference that disagrees is reported at once."""
    import metrale_feed.testing.reference as reference

    real = reference.host_next_token
    calls = {"n": 0}

    def off_by_one_later(history, vocab, dtype="float32", mask=(0xFFFFFFFF, 0xFFFFFFFF)):
        calls["n"] += 1
        token = real(history, vocab, dtype, mask)
        return (token + 1) % vocab if calls["n"] > 200 else token

    monkeypatch.setattr(reference, "host_next_token", off_by_one_later)
    soak = soak_tool.Soak(200, rows=4, vocab=64, block_size=4, max_len=24, seed=2)
    with pytest.raises(AssertionError, match="the host reference says"):
        soak.run()
    soak.close()


def test_soak_tool_cli(host, soak_tool, capsys):
    """``tools/soak.py`` prints the figures and says whether they were flat."""
    assert soak_tool.main(["--steps", "500"]) == 0
    out = capsys.readouterr().out
    assert "soak: 500 router steps" in out and "RSS at step 50" in out and "flat: True" in out
