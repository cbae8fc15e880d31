"""GPU benchmarks of kvgen's kernels, against physical ceilings measured in the same run.

- ``codec``, ``compact``, ``score``: one benchmark each (docstrings state the method), each also
  runnable alone: ``python -m kvgen.bench.codec`` etc.; their timer, ceilings, run record, inputs
  and oracle checks are ``kvgen.measure``'s, their libraries come through the runtime lookup;
- ``suite``: ``kvgen bench run`` -- all of them in one process, ceilings measured once, one
  ``bench.json``, tuned vs default registry;
- ``report``: ``kvgen bench report DIR`` -- ``report.md`` and PNG plots from ``DIR/bench.json``
  (needs matplotlib: ``pip install kvgen[report]``), and ``merge_recorded`` for older runs.

The command line (``kvgen bench ...`` or ``python -m kvgen.bench ...``): ``add_arguments(parser)``
adds the sub-commands to an argparse parser, ``run(args)`` runs the chosen one. Importing this
package imports neither torch nor matplotlib.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``run``, ``report`` and ``merge`` to ``parser`` (``kvgen bench``)."""
    from kvgen.bench.cli import add_arguments as _add

    _add(parser)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command ``add_arguments`` parsed; the exit status."""
    from kvgen.bench.cli import run as _run

    return _run(args)


__all__ = ["add_arguments", "run"]
