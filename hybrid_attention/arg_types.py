"""argparse types for the command lines (`cli.py`, `synth/cli.py`): numbers checked against their bounds, with an
error that names the bound and the text given."""

from __future__ import annotations

import argparse
import math


def number(kind, low, *, inclusive=True, high=None):
    """An argparse type: `kind` (int or float) parsed from the text, finite, >= low (> low unless `inclusive`) and
    <= high when given."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        ok = math.isfinite(value) and (value >= low if inclusive else value > low) and (high is None or value <= high)
        if not ok:
            bound = f"{'>=' if inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
            finite = "" if math.isfinite(value) else "finite "  # inf and nan parse as floats
            raise argparse.ArgumentTypeError(f"expected a {finite}value {bound}, got {text}")
        return value

    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
seed_int = number(int, 0, high=2**63 - 1)  # what torch.manual_seed takes
positive_float = number(float, 0.0, inclusive=False)
non_negative_float = number(float, 0.0)
