"""``python -m closedloop.samples NAME``: print the folder of a shipped sample (see the package docstring)."""

from __future__ import annotations

import argparse
import sys

from closedloop.samples import SAMPLES, sample_path

parser = argparse.ArgumentParser(prog="python -m closedloop.samples", description=__doc__.splitlines()[0])
parser.add_argument("name", choices=list(SAMPLES), help="the sample")
print(sample_path(parser.parse_args().name))
sys.exit(0)
