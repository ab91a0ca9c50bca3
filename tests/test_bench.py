"""``metrale-feed bench --quick --json FILE``: one real run, and every figure of the record is in
the JSON with a sane type and value. The timed targets are printed by the bench, not asserted
here: they depend on the machine."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("numpy")

CALLS = ["f()", "obj.m()", "Event.query()", "event_query(handle_int)", "event_query(Event)",
         "Event.record(0)", "copy_d2h_async 4 B", "argmax_to_feed 1x16 launch"]
SHAPES = {(256, 152064), (64, 32000)}  # the --quick shapes


def positive(value) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    command = [sys.executable, "-m", "metrale_feed.tools.cli", "bench", "--quick", "--json", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ratio" in done.stdout and "target" in done.stdout  # the table was printed
    with open(path) as f:
        return json.load(f)


def test_top_level_sections(record):
    assert {"machine", "import", "calls", "cimport", "argmax", "bandwidth", "router", "graphs"} <= set(record)
    assert record["quick"] is True
    assert positive(record["seconds"])


def test_machine(record):
    m = record["machine"]
    assert isinstance(m["cpu_count"], int) and m["cpu_count"] >= 1
    assert isinstance(m["numpy"], str) and m["numpy"]
    assert m["backend"] == "host"
    assert m["default_backend"] in ("host", "cuda", "simt")


def test_import_time(record):
    r = record["import"]
    assert positive(r["metrale_feed_us"]) and positive(r["numpy_us"]) and positive(r["ratio"])
    assert isinstance(r["imports_numpy"], bool) and isinstance(r["editable"], bool)
    assert r["runs"] == 3 and r["target_us"] == 5_000


def test_per_call_costs(record):
    calls = record["calls"]
    assert isinstance(calls["nvtx_built"], bool)
    for name in CALLS:
        entry = calls[name]
        assert positive(entry["ns"]) and positive(entry["ns_nvtx_off"]), name
        assert positive(entry["nvtx_ratio"]) and positive(entry["vs_f"]), name


def test_cimport_figure_or_reason(record):
    c = record["cimport"]
    if c["ns"] is None:
        assert isinstance(c["reason"], str) and c["reason"]
    else:
        assert positive(c["ns"]) and positive(c["ns_nvtx_off"]) and c["reason"] is None


def test_argmax_against_numpy(record):
    entries = record["argmax"]
    seen = {(e["dtype"], e["rows"], e["vocab"]) for e in entries}
    assert seen == {(d, r, v) for d in ("float32", "float16", "bfloat16") for r, v in SHAPES}
    for e in entries:
        assert e["checked"] is True  # the timed argmax agreed with numpy's
        assert e["bytes"] == e["rows"] * e["vocab"] * (4 if e["dtype"] == "float32" else 2)
        for key in ("ms_1", "ms_all", "numpy_ms", "ratio_1", "ratio_all", "bw_fraction_1",
                    "bw_fraction_all"):
            assert positive(e[key]), (key, e)
        assert e["torch_ms"] is None or positive(e["torch_ms"])
        if e["dtype"] == "bfloat16":
            assert "float32" in e["numpy_what"]
            for key in ("numpy_f16_ms", "ratio_f16_1", "ratio_f16_all"):
                assert positive(e[key]), (key, e)


def test_bandwidth(record):
    bw = record["bandwidth"]
    assert isinstance(bw["method"], str) and bw["method"]
    assert positive(bw["gbps_1"]) and positive(bw["gbps_all"]) and bw["gbps_all"] >= bw["gbps_1"]
    assert bw["bytes"] == 256 * 152064 * 4


def test_router(record):
    r = record["router"]
    assert (r["rows"], r["vocab"], r["max_new"], r["device_threads"]) == (64, 32000, 32, 1)
    assert positive(r["step_us"])
    levels = r["levels"]
    assert [lv["kind"] for lv in levels] == ["sleep", "sleep", "sleep", "spin"]
    assert levels[0]["host_work_us"] == 0
    assert levels[1]["host_work_us"] == pytest.approx(r["step_us"])
    assert levels[2]["host_work_us"] == pytest.approx(2 * r["step_us"])
    for lv in levels:
        assert lv["same_tokens"] is True
        assert positive(lv["async_tps"]) and positive(lv["sync_tps"]) and positive(lv["speedup"])
    assert positive(r["stub_us_per_step"]) and positive(r["stub_us_per_step_reserve"])
    per_step = r["pipeline_us_per_step"]
    assert sorted(map(int, per_step)) == [16, 64, 256, 1024]
    assert all(positive(v) for v in per_step.values())
    assert sorted(map(int, r["router_us_per_step_at"])) == [16, 64, 256, 1024]
    assert positive(r["pipeline_us_per_step_sampled"])
    sm = r["sampling"]
    assert sm["rows"] == 64 and sm["params"]["top_p"] == 0.9 and sm["params"]["temperature"] == 0.8
    assert sm["checked"] is True  # async == sync == the host sampler, request by request
    for key in ("sampled_tps", "greedy_tps", "sampled_step_us", "greedy_step_us", "ratio"):
        assert positive(sm[key]), key
    assert sm["ratio"] == pytest.approx(sm["sampled_step_us"] / sm["greedy_step_us"])
    assert all(positive(v) for v in r["router_us_per_step_at"].values())


def test_interop_figures(record):
    r = record["interop"]
    assert {"DeviceBuffer", "numpy array", "numpy array, numpy cells"} <= set(r["call_ns"])
    assert all(positive(v) for v in r["call_ns"].values())
    if "llama" in r:  # torch, transformers and the examples/ folder were found
        levels = r["llama"]["levels"]
        assert len(levels) == 3 and positive(r["llama"]["step_us"])
        for lv in levels:
            assert lv["same_tokens"] is True  # async and sync agree, token for token
            assert positive(lv["async_tps"]) and positive(lv["sync_tps"])


def test_graphs(record):
    g = record["graphs"]
    assert (g["rows"], g["vocab"], g["steps"]) == (8, 4096, 40)
    assert g["checked"] is True  # the graph's ids are the one-by-one path's
    assert g["captures"] == 1 and g["launches"] == 40  # one shape, one readback slot
    for key in ("eager_queue_us", "graph_queue_us", "eager_step_us", "graph_step_us"):
        assert positive(g[key]), key


def test_speculative(record):
    spec = record["speculative"]
    assert spec["checked"] is True
    assert [v["agree"] for v in spec["verify"]] == [1.0, 0.5]
    for v in spec["verify"]:
        assert v["checked"] is True and v["k"] == 4
        assert all(positive(v[name]) for name in ("argmax_ms", "verify_ms", "ratio"))
    pv = spec["verify_penalised"]  # every position decided, the penalised cells checked
    assert pv["checked"] is True and (pv["rows"], pv["k"]) == (64, 4)
    assert all(positive(pv[name]) for name in ("plain_ms", "penalised_ms", "ratio"))
    p = spec["pipeline"]
    assert p["same_tokens"] is True and p["host_syncs_equal_steps"] is True
    assert all(positive(p[f"{name}_tps"]) for name in ("speculative", "speculative_depth_2",
                                                       "plain_depth_1", "plain_depth_2"))
    assert p["depth_2_host_syncs"] == p["depth_2_steps"] > 0
    assert p["speculative_steps"] < p["plain_depth_1_steps"]  # acceptance 0.8 saves steps
    assert 0.3 < p["accepted_fraction"] < 0.9  # k = 4 at 0.8: 59 % in theory


def test_grammar(record):
    g = record["grammar"]
    assert g["checked"] is True
    if "skipped" in g:  # the grammar extra is not installed
        assert importlib.util.find_spec("outlines_core") is None
        return
    s = g["step"]
    assert (s["rows"], s["vocab"]) == (64, 152064) and s["checked"] is True
    assert 0 < s["string_rows"] < s["rows"]  # a mix: rows inside a string and at other states
    assert s["bitmask_bytes"] == 64 * s["words"] * 4 == 64 * 4752 * 4
    for name in ("argmax", "argmax_grammar", "sample", "sample_grammar", "engine", "engine_cached", "mask"):
        assert positive(s["ms"][name]), name
    assert positive(s["ratio"]["argmax"]) and positive(s["ratio"]["sample"])
    assert s["engine_ratio"] == pytest.approx(s["ms"]["engine"] / s["ms"]["argmax_grammar"])
    assert g["bounded_strings"] is None  # the full run's row only
    p = g["pipeline"]
    assert p["checked"] is True
    for run in (p["free"], p["grammar"]):
        assert positive(run["tps"]) and run["host_syncs"] == run["steps"] > 0  # depth 2: one a step
    assert p["free"]["finish"] == ["length"]
    assert p["ratio"] == pytest.approx(p["grammar"]["tps"] / p["free"]["tps"])


def test_grammar_section_says_what_it_needs_without_outlines_core(monkeypatch, capsys):
    from metrale_feed.tools.bench import grammar

    real = importlib.util.find_spec
    monkeypatch.setattr(grammar.importlib.util, "find_spec",
                        lambda name, *a: None if name == "outlines_core" else real(name, *a))
    assert grammar.bench_grammar(True) == {"skipped": "outlines-core is not installed", "checked": True}
    assert "pip install 'metrale-feed[grammar]'" in capsys.readouterr().out
