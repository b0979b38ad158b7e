"""``python -m logdx.synth`` (also wired as ``logdx synth``): write a synthetic job log."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

from logdx.synth.flavours import FLAVOURS
from logdx.synth.generate import SCENARIOS, Truth, generate
from logdx.synth.styles import STYLES


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The options; `add_help=False` when `logdx synth` adopts them as a subcommand's parent."""
    parser = argparse.ArgumentParser(
        prog="logdx synth", description="Write a realistic, deterministic log of a multi-rank training job.",
        add_help=add_help)
    parser.add_argument("--scenario", default="xid79", choices=sorted(SCENARIOS), metavar="NAME",
                        help="failure scenario (--list shows them); default xid79")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--lines", type=int, default=20000,
                        help="length of the log had the run not failed (a failure strikes at --fail-at of it)")
    parser.add_argument("--style", default="torchrun", choices=sorted(STYLES), help="line prefix style")
    parser.add_argument("--flavour", default="auto", choices=["auto", *sorted(FLAVOURS)], help="training framework")
    parser.add_argument("--fail-at", type=float, default=0.8, help="fraction of --lines at which the failure strikes")
    parser.add_argument("--noise", type=float, default=1.0, help="rate of harmless warnings (0 = none)")
    parser.add_argument("-o", "--output", default="-", help="log file; '-' for stdout (default)")
    parser.add_argument("--truth", help="write the ground truth as JSON to this file ('-' for stderr)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, SCENARIOS))
        for name, description in SCENARIOS.items():
            print(f"{name:<{width}}  {description}")
        return 0
    started = time.perf_counter()
    try:
        if args.output == "-":
            truth = _generate(sys.stdout, args)
            sys.stdout.flush()
        else:
            with open(args.output, "w", encoding="utf-8", newline="\n", buffering=1 << 20) as out:
                truth = _generate(out, args)
    except BrokenPipeError:  # e.g. piped into `head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ValueError as error:
        print(f"logdx synth: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    if args.truth == "-":
        print(truth.to_json(), file=sys.stderr)
    elif args.truth:
        with open(args.truth, "w", encoding="utf-8") as f:
            f.write(truth.to_json() + "\n")
    rate = truth.lines_written / max(elapsed, 1e-9)
    print(f"logdx synth: {truth.lines_written} lines in {elapsed:.1f}s ({rate:,.0f} lines/s); "
          f"{truth.scenario}: root line {truth.root_line_no}", file=sys.stderr)
    return 0


def _generate(out: TextIO, args: argparse.Namespace) -> Truth:
    return generate(out, scenario=args.scenario, seed=args.seed, ranks=args.ranks, gpus_per_host=args.gpus_per_host,
                    lines=args.lines, style=args.style, fail_at=args.fail_at, noise=args.noise, flavour=args.flavour)
