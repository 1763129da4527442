"""The command line every loader peer takes (bench/peers/*_loader.py), so that compare-pipeline
runs them all on the same terms: threads (or workers), batch, epochs per run with the first
untimed, repeats."""
import argparse


def _at_least(least):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: '{text}'") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, not {value}")
        return value
    return parse


def loader_args(prog, what, threads_flag="--threads", extra=None):
    """Parses `what` (the data argument's help) and the shared options, each checked (threads,
    batch and repeats >= 1; epochs >= 2, the first being a warm-up); `extra(parser)` adds a peer's own."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("data", help=what)
    # At least one: 0 would mean "all cores" to one tool and "the main process" to another.
    ap.add_argument(threads_flag, dest="threads", type=_at_least(1), default=2)
    ap.add_argument("--batch", type=_at_least(1), default=256)
    ap.add_argument("--epochs", type=_at_least(2), default=3, help="per run; the first is not timed")
    ap.add_argument("--repeats", type=_at_least(1), default=3)
    if extra is not None:
        extra(ap)
    return ap.parse_args()
