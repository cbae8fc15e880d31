"""``python -m kvgen.demo``: the same as ``kvgen demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvgen.demo import add_arguments, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgen demo", description="a serving scenario driven the way an inference engine would drive kvgen")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
