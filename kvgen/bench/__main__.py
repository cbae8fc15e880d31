"""``python -m kvgen.bench run|report|merge`` (the same as ``kvgen bench``, without rich or pydantic
at start-up)."""

from __future__ import annotations

import argparse
import sys

from kvgen.bench import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgen.bench",
                                     description="kvgen's GPU benchmarks against ceilings measured in the same run")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
