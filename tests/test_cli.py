"""The ``metrale-feed`` command as a newcomer meets it: every wrong option ends in one line that
names it (no traceback, before any work), the default demo explains what it showed and checked,
``info`` explains the cuda backend's state in words, ``--version``, and the bench's verdicts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

import metrale_feed
from metrale_feed.tools import bench, cli

SCRIPT = os.path.join(os.path.dirname(sys.executable), "metrale-feed")


def command(*args, env_extra=None, timeout=120):
    """The installed console script in a fresh process, METRALE_FEED_* cleared."""
    assert os.path.exists(SCRIPT), f"the console script is not installed beside {sys.executable}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}
    env.update(env_extra or {})
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def parse_error(capsys, *argv):
    """The one-line message and status of a command line the parser refuses (in this process:
    a refused line must end before any demo work starts)."""
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    err = capsys.readouterr().err
    return exited.value.code, err


BAD = [
    (["--rows", "0"], "--rows", "1 to 4,096"),
    (["--rows", "100000"], "--rows", "1 to 4,096"),
    (["--rows", "-3"], "--rows", "1 to 4,096"),
    (["--rows", "2.5"], "--rows", "1 to 4,096"),
    (["--tokens", "0"], "--tokens", "1 to"),
    (["--vocab", "1"], "--vocab", "3 to"),
    (["--vocab", "2"], "--vocab", "3 to"),
    (["--block-size", "0"], "--block-size", "1 to"),
    (["--seed", "-1"], "--seed", "0 to"),
    (["--seed", "abc"], "--seed", "0 to"),
    (["--host-work-us", "-5"], "--host-work-us", "0 to"),
    (["--host-work-us", "nan"], "--host-work-us", "0 to"),
    (["--host-work-us", "inf"], "--host-work-us", "0 to"),
    (["--host-work-us", "fast"], "--host-work-us", "'step'"),
    (["--device-threads", "-1"], "--device-threads", "0 to"),
    (["--device-threads", str(cli.usable_cores() + 1)], "--device-threads",
     f"to {cli.usable_cores()}"),
    (["--dtype", "int8"], "--dtype", "float32"),
    (["--host-work", "busy"], "--host-work", "sleep"),
    (["--backend", "tpu"], "--backend", "host"),
    (["--trace", os.path.join("no-such-folder-here", "t.json")], "--trace", "does not exist"),
    (["--rows", "4096", "--tokens", "100000"], "--tokens", "host reference"),
    (["--temperature", "-0.5"], "--temperature", "[0, 1000]"),
    (["--temperature", "nan"], "--temperature", "[0, 1000]"),
    (["--temperature", "inf"], "--temperature", "[0, 1000]"),
    (["--temperature", "warm"], "--temperature", "[0, 1000]"),
    (["--top-k", "-1"], "--top-k", "0 to 4,294,967,295"),
    (["--top-k", "2**32"], "--top-k", "0 to 4,294,967,295"),
    (["--top-p", "0"], "--top-p", "(0, 1]"),
    (["--top-p", "1e-50"], "--top-p", "(0, 1]"),  # 0 as float32, the sampler's width
    (["--top-p", "1.01"], "--top-p", "(0, 1]"),
    (["--min-p", "1"], "--min-p", "[0, 1)"),
    (["--min-p", "0.99999999"], "--min-p", "[0, 1)"),  # 1 as float32
    (["--min-p", "-0.1"], "--min-p", "[0, 1)"),
]


@pytest.mark.parametrize("argv, option, range_words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_wrong_demo_option_is_one_line_naming_it(capsys, argv, option, range_words):
    start = time.perf_counter()
    code, err = parse_error(capsys, "demo", *argv)
    assert time.perf_counter() - start < 5  # refused before any host reference is computed
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert option in lines[0] and range_words in lines[0], lines[0]
    assert "Traceback" not in err


def test_the_console_script_refuses_in_one_line_without_a_traceback():
    start = time.perf_counter()
    done = command("demo", "--rows", "100000")
    assert time.perf_counter() - start < 30  # it once ran for more than ten minutes
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--rows" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unknown_option_or_command_is_one_line(capsys):
    for argv in (["demo", "--bogus"], ["frobnicate"], []):
        code, err = parse_error(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1, (argv, err)


def test_every_demo_option_has_help_that_states_it(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = capsys.readouterr().out
    for option in ("--rows", "--tokens", "--vocab", "--dtype", "--seed", "--block-size",
                   "--backend", "--host-work-us", "--host-work", "--device-threads", "--trace",
                   "--plot", "--quiet", "--temperature", "--top-k", "--top-p", "--min-p"):
        assert option in text
    assert "metrale-feed[plot]" in text.replace("\n", " ").replace("  ", " ")


def test_plot_without_matplotlib_names_the_extra_before_running(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    code, err = parse_error(capsys, "demo", "--plot", str(tmp_path / "run.png"))
    assert code == 2
    assert "pip install 'metrale-feed[plot]'" in err and "--plot" in err
    assert len(err.strip().splitlines()) == 1


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"metrale-feed {version('metrale-feed')}"
    assert metrale_feed.__version__ == version("metrale-feed")


def test_dir_lists_the_lazy_names_and_each_resolves():
    names = dir(metrale_feed)
    for name in ("AsyncDeviceIo", "SyncDeviceIo", "ModelDeviceFeed", "RuntimeFeedMixin",
                 "SequenceState", "BlockPool", "reference_argmax"):
        assert name in names
    for name in names:
        getattr(metrale_feed, name)  # nothing listed is missing


# ---- the default demo ----

def test_the_default_scenario_measures_a_step_and_says_what_it_checked():
    # The default's shape, made small: host work per step = one measured device step.
    done = command("demo", "--rows", "8", "--tokens", "12", "--vocab", "4000", "--quiet",
                   env_extra={"METRALE_FEED_BACKEND": "host"})
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    step = re.search(r"measured device step: ([\d.]+) (ms|us)", out)
    assert step, out
    measured = float(step.group(1)) * (1000 if step.group(2) == "ms" else 1)
    work = re.search(r"scheduler's own work takes ([\d.]+) (ms|us) per step, one device step", out)
    assert work, out
    assert float(work.group(1)) * (1000 if work.group(2) == "ms" else 1) == pytest.approx(
        measured, rel=0.01, abs=1)
    assert re.search(r"result: the async router finished [\d.]+x as fast as the sync one", out)
    assert out.count("checked: ") == 3 and "FAILED" not in out
    assert "tokens of both routers equal the host computation" in out
    assert "--host-work-us 0" in out and "--plot" in out  # where to go next
    assert "{" not in out  # no raw stats dict as the message


def test_no_host_work_says_there_is_nothing_to_overlap():
    done = command("demo", "--rows", "4", "--tokens", "6", "--vocab", "1000", "--quiet",
                   "--host-work-us", "0", "--host-work", "spin",
                   env_extra={"METRALE_FEED_BACKEND": "host"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "measured device step" not in done.stdout
    assert "no host work" in done.stdout and "nothing to overlap" in done.stdout


def test_a_sampled_demo_checks_every_token_against_the_host_sampler():
    done = command("demo", "--rows", "6", "--tokens", "10", "--vocab", "500", "--quiet",
                   "--host-work-us", "0", "--temperature", "0.8", "--top-p", "0.9",
                   "--top-k", "50", "--min-p", "0.01", "--dtype", "bfloat16",
                   env_extra={"METRALE_FEED_BACKEND": "host"})
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "sampling: temperature 0.8, top_k 50, top_p 0.9, min_p 0.01" in out
    assert out.count("checked: ") == 3 and "FAILED" not in out
    assert "equal the host sampler's draws" in out


def test_the_demo_reference_of_a_sampled_request_is_not_the_greedy_one(host, no_leaks):
    """The sampled check can fail: its references leave the argmax's path, and both routers
    meet them."""
    from metrale_feed.tools import demo
    from metrale_feed.testing.reference import ReferenceModel

    sampling = {"temperature": 1.5, "top_k": 0, "top_p": 0.95, "min_p": 0.0}
    reqs = demo.make_requests(6, 8, 300, "float32", 3, sampling)
    assert len({r["sampling"]["seed"] for r in reqs}) == 6
    greedy = [demo.host_reference(r["prompt"], r["mask"], r["stop"], 8, 300, "float32")
              for r in reqs]
    expected = [demo.host_reference(r["prompt"], r["mask"], r["stop"], 8, 300, "float32",
                                    r["sampling"]) for r in reqs]
    assert expected != greedy
    with ReferenceModel(300, max_rows=6) as model:
        assert demo.run_async(model, reqs, 8)["tokens"] == expected
        assert demo.run_sync(model, reqs, 8)["tokens"] == expected


# ---- the cuda backend's state, in words ----

def _libcuda_loads():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_info_with_cuda_asked_for_explains_instead_of_a_traceback():
    done = command("info", env_extra={"METRALE_FEED_BACKEND": "cuda"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    out = done.stdout
    build = metrale_feed.build_info()
    if not build["cuda"]:
        assert "this build has no CUDA backend" in out and "METRALE_FEED_CUDA=ON" in out
    elif "backend: cuda" in out:
        assert "devices:" in out
    else:
        assert "cuda backend: unusable:" in out
        if not _libcuda_loads():
            assert "no NVIDIA driver is installed" in out
            assert "update" not in out and "upgrade" not in out  # no GPU: no driver advice


def test_a_bogus_backend_name_is_explained_by_info():
    done = command("info", env_extra={"METRALE_FEED_BACKEND": "tpu"})
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert "must be auto, cuda, host or simt, not 'tpu'" in done.stdout


def test_demo_with_an_unusable_cuda_backend_is_one_line():
    for argv, env in ((["demo", "--backend", "cuda"], {}),
                      (["demo"], {"METRALE_FEED_BACKEND": "cuda"})):
        done = command(*argv, "--rows", "2", "--tokens", "2", "--vocab", "100", env_extra=env)
        if done.returncode == 0:
            assert "backend: cuda" in done.stdout  # a usable GPU: nothing to refuse
            continue
        assert done.returncode == 2, done.stderr
        assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr and "cuda" in done.stderr


class FakeCudaError(metrale_feed.FeedError):
    def __init__(self, name):
        super().__init__(f"{name}: something")
        self.name = name


BUILD = {"cuda": True, "cuda_version": "13.0", "architectures": ["sm_90"]}


def test_explain_no_driver_never_advises_an_update(monkeypatch):
    monkeypatch.setattr(cli, "_driver_cuda_version", lambda: (False, 0))
    text = cli.explain_cuda(FakeCudaError("cudaErrorInsufficientDriver"), BUILD)
    assert "no NVIDIA driver" in text and "update" not in text and "upgrade" not in text


def test_explain_an_old_driver_names_both_versions(monkeypatch):
    monkeypatch.setattr(cli, "_driver_cuda_version", lambda: (True, 12020))
    text = cli.explain_cuda(FakeCudaError("cudaErrorInsufficientDriver"), BUILD)
    assert "CUDA 12.2" in text and "CUDA 13.0" in text and "update the driver" in text


def test_explain_the_other_states(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "sees no GPU" in cli.explain_cuda(FakeCudaError("cudaErrorNoDevice"), BUILD)
    assert "CUDA_VISIBLE_DEVICES=''" in cli.explain_cuda(FakeCudaError("cudaErrorNoDevice"), BUILD)
    assert "sm_90" in cli.explain_cuda(FakeCudaError("cudaErrorNoKernelImageForDevice"), BUILD)
    assert "busy" in cli.explain_cuda(FakeCudaError("cudaErrorDevicesUnavailable"), BUILD)
    no_build = cli.explain_cuda(metrale_feed.FeedError("no CUDA backend"), {"cuda": False})
    assert "no CUDA backend" in no_build and "METRALE_FEED_CUDA=ON" in no_build
    other = cli.explain_cuda(FakeCudaError("cudaErrorLaunchFailure"), BUILD)
    assert other.startswith("cudaErrorLaunchFailure")


# ---- the bench's verdicts ----

@pytest.mark.parametrize("value, ratio, target, expected", [
    ("2.80 ms", "", "< 10 ms", "met"),
    ("12.0 ms", "", "< 10 ms", "MISSED"),
    ("10.0 ms", "", "< 10 ms", "MISSED"),
    ("10.0 ms", "", "<= 10 ms", "met"),
    ("26.8 ns", "1.15x f()", "<= 60 ns", "met"),
    ("61.0 ns", "2.00x f()", "<= 60 ns", "MISSED"),
    ("0.5 us", "", "<= 60 ns", "MISSED"),  # units converted, not compared as digits
    ("0.05 us", "", "<= 60 ns", "met"),
    ("5.71 ms", "1.04x", ">= 1.0x", "met"),
    ("5.71 ms", "0.95x", ">= 1.0x", "MISSED"),
    ("18025 tok/s", "0.95x", ">= 0.95x", "met"),
    ("no", "", "no", "met"),
    ("yes", "", "no", "MISSED"),
    ("null", "", "<= 15 ns", "not measured"),
    ("1.0 ms", "", "", ""),
])
def test_bench_verdict(value, ratio, target, expected):
    assert bench.verdict(value, ratio, target) == expected


def test_bench_cimport_reason_names_the_extra():
    reason = bench.cimport_reason("cython: /usr/bin/python3: No module named cython")
    assert "pip install 'metrale-feed[cython]'" in reason
    from importlib.metadata import metadata

    extras = metadata("metrale-feed").get_all("Provides-Extra") or []
    assert "cython" in extras and "plot" in extras  # the extras the messages name exist


def test_the_plot_is_drawn_with_titles_that_say_what_to_look_for(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed here")
    png, trace = tmp_path / "run.png", tmp_path / "run.json"
    done = command("demo", "--quiet", "--rows", "4", "--tokens", "6", "--vocab", "500",
                   "--plot", str(png), "--trace", str(trace),
                   env_extra={"METRALE_FEED_BACKEND": "host"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json

    names = [e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("name") == "process_name"]
    assert any("look for the device lane busy while the host works" in n for n in names), names
    assert any("the device idles while the host works" in n for n in names), names
