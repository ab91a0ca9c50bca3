"""The ``metrale-feed`` command: ``info``, ``demo`` and ``bench``.

Every option is checked when the command line is read: a wrong one ends the command with one line
that names the option and its range (exit status 2), before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
from typing import Any, Callable, List, Mapping, NoReturn, Optional, Tuple

# The most rows one decode step (one kernel launch) takes; the C layer and the routers refuse more.
MAX_ROWS = 4096
MAX_TOKENS = 100_000  # new tokens per row; the demo also checks the host reference's cost
MAX_VOCAB = 1 << 20
MAX_BLOCK_SIZE = 4096
MAX_HOST_WORK_US = 10_000_000.0  # ten seconds a step is no longer a scheduler's bookkeeping
MAX_TEMPERATURE = 1000.0  # far past flat: softmax(logit / 1000) of logits in [0, 1) is uniform
# The host reference costs 3 to 7 ns a logit (numpy, one core): this keeps it to a few minutes.
MAX_REFERENCE_LOGITS = 2e10
PLOT_EXTRA = "pip install 'metrale-feed[plot]'"


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line: the command, the option, what it takes."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer from {low:,} to {high:,}{why}, not {text!r}")
        return value
    return parse


def _float_in(low: float, high: float, *, open_low: bool = False, open_high: bool = False,
              why: str = "") -> Callable[[str], float]:
    """A finite number in ``[low, high]``, either end open: the sampling options' ranges are
    the sampler's (docs/kernels.md), refused here in one line rather than at submit."""
    span = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"

    def parse(text: str) -> float:
        try:
            # As float32, the sampler's width: 1e-50 is 0 there, 0.99999999 is 1.
            value = struct.unpack("<f", struct.pack("<f", float(text)))[0]
        except (ValueError, OverflowError):
            value = math.nan
        ok = (low < value if open_low else low <= value) and (
            value < high if open_high else value <= high)  # NaN fails both
        if not ok:
            raise argparse.ArgumentTypeError(f"must be a number in {span}{why}, not {text!r}")
        return value
    return parse


def _host_work(text: str) -> Optional[float]:
    """``step`` (None: one measured device step) or microseconds."""
    if text.strip().lower() == "step":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= MAX_HOST_WORK_US:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be 'step' (one measured device step) or microseconds from 0 to "
            f"{MAX_HOST_WORK_US:,.0f}, not {text!r}")
    return value


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _folder_of(parser: argparse.ArgumentParser, option: str, path: Optional[str]) -> None:
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            parser.error(f"argument {option}: the folder {folder!r} does not exist")
        if not os.access(folder, os.W_OK):
            parser.error(f"argument {option}: the folder {folder!r} is not writable")


# ---- the CUDA backend's state, in words ----

def _driver_cuda_version() -> Tuple[bool, int]:
    """(whether an NVIDIA driver library loads, the CUDA version it supports or 0)."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, 0
    version = ctypes.c_int(0)
    try:
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return True, 0
    except AttributeError:
        return True, 0
    return True, version.value


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def explain_cuda(error: BaseException, build: Optional[Mapping[str, Any]] = None) -> str:
    """Why the cuda backend is unusable, in words a user can act on."""
    if build is not None and not build.get("cuda"):
        return ("this build has no CUDA backend (it was built without nvcc, or with "
                "METRALE_FEED_CUDA=OFF); reinstall with nvcc on PATH and METRALE_FEED_CUDA=ON")
    name = getattr(error, "name", "") or ""
    if "no CUDA backend" in str(error):
        return explain_cuda(error, {"cuda": False})
    if name == "cudaErrorInsufficientDriver":
        loaded, supports = _driver_cuda_version()
        if not loaded:
            return ("no NVIDIA driver is installed (libcuda.so.1 cannot be loaded), so there is no "
                    "usable GPU here")
        needs = (build or {}).get("cuda_version")
        needed = f"CUDA {needs}" if needs else "this build's CUDA runtime"
        has = f"CUDA {_cuda_version(supports)}" if supports else "an older CUDA"
        return (f"the NVIDIA driver supports {has} but this build needs {needed}: update the "
                f"driver, or build with an older CUDA toolkit")
    if name in ("cudaErrorNoDevice", "cudaErrorInvalidDevice"):
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={hidden!r} hides the others)" if hidden is not None else ""
        return f"the NVIDIA driver is installed but sees no GPU{where}"
    if name == "cudaErrorDevicesUnavailable":
        return ("the GPUs are busy or unavailable (exclusive-process compute mode, or taken by "
                "another process)")
    if name in ("cudaErrorNoKernelImageForDevice", "cudaErrorUnsupportedPtxVersion"):
        archs = " ".join((build or {}).get("architectures", [])) or "none"
        return (f"this GPU's architecture is not among this build's ({archs}); rebuild with "
                f"METRALE_FEED_CUDA_ARCHS including it")
    return f"{name or type(error).__name__}: {error}"


def _import_package(command: str) -> Tuple[Any, Optional[BaseException]]:
    """``metrale_feed``, and the error that refused METRALE_FEED_BACKEND (None when none did). A
    refused backend leaves the host backend active for ``info``; the other commands stop with one
    line. (The package keeps the refusal for the ``metrale-feed`` command instead of raising.)"""
    import metrale_feed

    error = metrale_feed._env_refused
    if error is not None and command != "info":
        wanted = os.environ.get("METRALE_FEED_BACKEND", "")
        if isinstance(error, ValueError):
            reason = str(error)
        else:
            reason = f"the cuda backend is unusable: {explain_cuda(error, metrale_feed.build_info())}"
        print(f"metrale-feed {command}: METRALE_FEED_BACKEND={wanted} is refused: {reason}; "
              f"unset it or set it to host", file=sys.stderr)
        sys.exit(2)
    return metrale_feed, error


def info(_: argparse.Namespace) -> int:
    mf, refused = _import_package("info")
    from .. import _core

    build = mf.build_info()
    print(f"metrale_feed {mf.__version__}")
    if build["cuda"]:
        cuda = f"CUDA {build['cuda_version']}, kernels for {' '.join(build['architectures'])}"
    else:
        cuda = "host only (no CUDA backend was built)"
    print(f"build: {cuda}; NVTX {'on' if build['nvtx'] else 'off'}")
    if isinstance(refused, ValueError):  # a value that names no backend
        print(f"backend: {mf.backend()} (refused: {refused})")
    elif refused is not None:
        print(f"backend: {mf.backend()} (METRALE_FEED_BACKEND=cuda was refused: see below)")
    else:
        print(f"backend: {mf.backend()}")
    if mf.backend() == "cuda":
        driver = _cuda_version(_core.driver_version())
        print(f"devices: {', '.join(mf.devices())} (the driver supports CUDA {driver})")
        return 0
    host = ("the host backend runs everything, asynchronously (a worker thread per stream keeps "
            "CUDA's semantics)")
    active = mf.backend()
    if active == "simt":
        simt = mf.simt_config()
        host = ("the simt backend: the host backend's runtime, with the CUDA kernels themselves (the "
                ".cu sources, built by the host compiler) run on the CPU by a fiber executor that "
                "checks every barrier and shuffle; launch planning for "
                f"{simt['sm_count']} SMs, blocks {simt['order']} on {simt['threads']} thread(s)")
    if not build["cuda"]:
        print(f"cuda backend: none: {explain_cuda(RuntimeError(), build)}")
        print(host)
        return 0
    try:
        mf.set_backend("cuda")
    except mf.FeedError as error:
        print(f"cuda backend: unusable: {explain_cuda(error, build)}")
        print(host)
    else:
        print(f"devices: {', '.join(mf.devices())} (the cuda backend is usable; active: {active})")
        mf.set_backend(active)
    return 0


# ---- demo: the checks that need more than one option ----

def check_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks of ``demo`` that span options or the machine; each ends in ``parser.error``."""
    cores = usable_cores()
    if args.device_threads > cores:
        parser.error(f"argument --device-threads: must be from 0 (every core) to {cores} (the "
                     f"cores usable here), not {args.device_threads}")
    if args.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            parser.error(f"argument --plot: needs matplotlib, which is not installed: {PLOT_EXTRA}")
        if not args.plot.lower().endswith((".png", ".svg", ".pdf")):
            parser.error(f"argument --plot: the file must end in .png, .svg or .pdf, not "
                         f"{args.plot!r}")
    _folder_of(parser, "--plot", args.plot)
    _folder_of(parser, "--trace", args.trace)
    if args.tp is not None:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            parser.error("argument --tp: needs torch.distributed, which is not installed: "
                         "pip install 'metrale-feed[torch]'")
        if args.trace or args.plot:
            parser.error("argument --tp: --trace and --plot are for the single-rank demo")
    itemsize = 4 if args.dtype == "float32" else 2
    logits = args.rows * args.vocab * itemsize
    if hasattr(os, "sysconf"):
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = 0
        if memory and logits > memory // 4:
            parser.error(f"arguments --rows x --vocab: {args.rows} x {args.vocab} {args.dtype} "
                         f"logits take {logits / 2**30:.1f} GiB, more than a quarter of this "
                         f"machine's {memory / 2**30:.1f} GiB")
    # The host reference is computed in Python and numpy: bound it to minutes, not hours.
    work = args.rows * args.tokens * args.vocab
    if work > MAX_REFERENCE_LOGITS:
        parser.error(f"arguments --rows x --tokens x --vocab: {args.rows} x {args.tokens} x "
                     f"{args.vocab} = {work:.2g} logits for the host reference to compute, more "
                     f"than {MAX_REFERENCE_LOGITS:.0e} (a few minutes); lower one of them")
    if args.backend != "host":  # a refused METRALE_FEED_BACKEND stops here, in one line
        _import_package("demo")
    import metrale_feed as mf

    if args.backend == "cuda" and mf.backend() != "cuda":
        try:
            mf.set_backend("cuda")
        except mf.FeedError as error:
            parser.error(f"argument --backend: cuda is unusable: "
                         f"{explain_cuda(error, mf.build_info())}; use --backend host")


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo

    return int(demo.main(args))


def _run_bench(args: argparse.Namespace) -> int:
    _import_package("bench")
    from . import bench

    return int(bench.main(args))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("metrale-feed")
    except PackageNotFoundError:  # run from a source tree
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="metrale-feed", description=__doc__.split("\n\n")[0])
    top.add_argument("--version", action="version", version=f"metrale-feed {_version()}")
    sub = top.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("info", help="version, build, backend and devices, and why a backend is "
                   "unusable").set_defaults(run=info)

    demo = sub.add_parser(
        "demo", help="the async router against the sync one on the reference model, checked",
        description="Decodes random requests on the reference model twice, through the async "
        "router (step k+1 launched from the device feed cells before step k is read) and the "
        "sync one, with the scheduler's own work per step between them; checks every token "
        "against the host computation. By default the host work per step equals one measured "
        "device step, as a scheduler has, so the async router shows the overlap.")
    demo.add_argument("--rows", type=_int_in(1, MAX_ROWS, " (the most rows one decode step "
                      "takes)"), default=64, help=f"requests decoded together (1 to {MAX_ROWS})")
    demo.add_argument("--tokens", type=_int_in(1, MAX_TOKENS), default=128,
                      help=f"new tokens per row, at most (1 to {MAX_TOKENS:,})")
    demo.add_argument("--vocab", type=_int_in(3, MAX_VOCAB, " (a row masks two ids and needs "
                      "one left)"), default=32000, help=f"vocabulary size (3 to {MAX_VOCAB:,})")
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                      help="the logits' dtype")
    demo.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0,
                      help="seed of the random prompts and masks")
    demo.add_argument("--block-size", type=_int_in(1, MAX_BLOCK_SIZE), default=16,
                      help=f"KV cache block size, in tokens (1 to {MAX_BLOCK_SIZE})")
    demo.add_argument("--backend", default="auto", choices=["auto", "host", "cuda", "simt"],
                      help="auto: cuda when usable, else host (simt: the CUDA kernels on the CPU)")
    demo.add_argument("--host-work-us", type=_host_work, default=None, metavar="{step,US}",
                      help="the scheduler's own work per step, in microseconds; 'step' (the "
                      "default) measures one device step first and uses that; 0 for none")
    demo.add_argument("--host-work", default="sleep", choices=["sleep", "spin"],
                      help="how the host work is spent: off the CPU, or spinning in Python")
    demo.add_argument("--device-threads", type=_int_in(0, 1024), default=1,
                      help="host backend: cores the simulated device uses (0: all); the rest "
                           "are the scheduler's, as beside a real GPU")
    demo.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto) of "
                      "both runs")
    demo.add_argument("--plot", metavar="FILE.png", help="draw the host and device lanes of both "
                      f"runs (needs matplotlib: {PLOT_EXTRA})")
    demo.add_argument("--temperature", type=_float_in(0.0, MAX_TEMPERATURE, why=" (0: greedy)"),
                      default=0.0, help="sample every request at this temperature (0, the "
                      f"default: greedy decoding; at most {MAX_TEMPERATURE:g})")
    demo.add_argument("--top-k", type=_int_in(0, 2**32 - 1, " (0: every id)"), default=0,
                      help="sampling: keep the k most probable ids (0: all)")
    demo.add_argument("--top-p", type=_float_in(0.0, 1.0, open_low=True), default=1.0,
                      help="sampling: keep the most probable ids up to this probability, in "
                      "(0, 1] (1: all)")
    demo.add_argument("--min-p", type=_float_in(0.0, 1.0, open_high=True), default=0.0,
                      help="sampling: keep the ids at least this fraction as probable as the "
                      "most probable, in [0, 1) (0: all)")
    demo.add_argument("--tp", type=_int_in(2, 8), default=None, metavar="N",
                      help="also decode SPMD on N local ranks, each holding a slice of the "
                      "vocabulary (gloo; needs torch), and check their tokens equal the "
                      "single-rank run's")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=_run_demo, check=lambda a: check_demo(demo, a))

    bench = sub.add_parser("bench", help="the performance record, side by side, each target "
                           "marked met or missed")
    bench.add_argument("--json", metavar="FILE.json", help="also write the figures to this file")
    bench.add_argument("--quick", action="store_true", help="fewer repeats: under a minute")
    bench.add_argument("--peaked", action="store_true",
                       help="the sampling figures on peaked, LM-like logits too (beside the flat "
                       "standard normal ones)")
    bench.add_argument("--tp", type=_int_in(2, 8), default=None, metavar="N",
                       help="only the tensor-parallel figures: the sharded argmax over N local "
                       "ranks beside all-gathering the logits (needs torch)")
    bench.set_defaults(run=_run_bench,
                       check=lambda a: _folder_of(bench, "--json", a.json))
    return top


def main(argv: Optional[List[str]] = None) -> int:
    """Run the ``metrale-feed`` command.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program name; ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        The exit status: 0 when everything ran and every check passed, 1 when a check failed.
        A wrong option exits with status 2 and one line on stderr.

    Examples
    --------
    >>> from metrale_feed.tools.cli import main
    >>> main(["info"])  # doctest: +SKIP
    0
    """
    args = parser().parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
