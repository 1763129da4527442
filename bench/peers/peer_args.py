"""The command line every loader peer takes (bench/peers/*_loader.py), so that compare-pipeline
runs them all on the same terms: threads (or workers), batch, epochs per run with the first
untimed, repeats."""
import argparse
import sys


def loader_args(prog, what, threads_flag="--threads"):
    """Parses `what` (the data argument's help) and the shared options; exits on --epochs < 2."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("data", help=what)
    ap.add_argument(threads_flag, dest="threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3, help="per run; the first is not timed")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.epochs < 2:
        sys.exit(f"{prog}: --epochs must be >= 2 (the first is a warm-up)")
    return a
