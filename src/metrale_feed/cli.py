"""The ``metrale-feed`` command: ``info``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def info(_: argparse.Namespace) -> int:
    import metrale_feed as mf

    build = mf.build_info()
    print(f"metrale_feed {mf.__version__}")
    cuda = f"CUDA {build['cuda_version']}, kernels for {' '.join(build['architectures'])}" if build["cuda"] else "host only"
    print(f"build: {cuda}; NVTX {'on' if build['nvtx'] else 'off'}")
    print(f"backend: {mf.backend()}")
    if not build["cuda"]:
        print("devices: none (this build has no CUDA backend)")
    elif mf.backend() == "cuda":
        print(f"devices: {', '.join(mf.devices())} (driver {mf.driver_version()})")
    else:
        try:
            mf.set_backend("cuda")
        except mf.FeedError as error:
            name = getattr(error, "name", "")
            print(f"devices: none usable ({name or 'error'}): {error}")
        else:
            print(f"devices: {', '.join(mf.devices())} (cuda backend usable; active: host)")
            mf.set_backend("host")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="metrale-feed", description=__doc__)
    sub = top.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, build, backend and devices").set_defaults(run=info)

    demo = sub.add_parser("demo", help="async vs sync router on the reference model, checked")
    demo.add_argument("--rows", type=int, default=64)
    demo.add_argument("--tokens", type=int, default=128, help="new tokens per row, at most")
    demo.add_argument("--vocab", type=int, default=32000)
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--backend", default="auto", choices=["auto", "host", "cuda"])
    demo.add_argument("--host-work-us", type=float, default=0.0,
                      help="simulated scheduler work per step, in microseconds")
    demo.add_argument("--host-work", default="sleep", choices=["sleep", "spin"],
                      help="how the host work is spent: off the CPU, or spinning in Python")
    demo.add_argument("--device-threads", type=int, default=1,
                      help="host backend: cores the simulated device uses (0: all); the rest "
                           "are the scheduler's, as beside a real GPU")
    demo.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto) of both runs")
    demo.add_argument("--plot", metavar="FILE.png", help="draw host and device lanes (needs matplotlib)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(run=lambda a: __import__("metrale_feed.demo", fromlist=["main"]).main(a))

    bench = sub.add_parser("bench", help="the performance record, side by side")
    bench.add_argument("--json", help="also write the figures to this file")
    bench.add_argument("--quick", action="store_true", help="fewer repeats: under a minute")
    bench.set_defaults(run=lambda a: __import__("metrale_feed.bench", fromlist=["main"]).main(a))
    return top


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
