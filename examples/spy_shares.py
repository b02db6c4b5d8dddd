"""Shares of a sampling profile: reads py-spy's raw output (`py-spy record --format raw --threads
--native --idle ...`, one collapsed stack and its sample count per line) and prints, per thread,
the samples and the frames most often on the stack; with --under FRAME, the tree of frames below
the first frame that starts with FRAME (on the threads that reach it), to --depth levels. Frames of
unnamed native code (bare addresses) are left out of the tree. Used for "One and two ranks on one
machine" in docs/benchmarks.md:

    python examples/spy_shares.py spy.txt --top 20
    python examples/spy_shares.py spy.txt --under "DistributedZeroOptimizer.step" --depth 4
"""
import argparse
import collections


def read(path):
    """(process, thread, frames, samples) per line of py-spy's raw format. With --subprocesses a
    stack starts with its process's ancestors; the process is the last of them."""
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
        if at and count.isdigit():
            yield frames[at - 1], frames[at], frames[at + 1:], int(count)


def per_thread(rows):
    """(process, thread) -> (samples, Counter of frame -> samples it was on the stack)."""
    totals, frames_seen = collections.Counter(), collections.defaultdict(collections.Counter)
    for process, thread, frames, n in rows:
        totals[(process, thread)] += n
        for f in set(frames):
            frames_seen[(process, thread)][f] += n
    return {k: (totals[k], frames_seen[k]) for k in totals}


def tree_under(rows, under, depth):
    """Counter of frame paths below the first frame that starts with `under` (the empty path:
    all samples that reach it), to `depth` frames; bare addresses left out."""
    tree = collections.Counter()
    for _, _, frames, n in rows:
        at = next((i for i, f in enumerate(frames) if f.startswith(under)), None)
        if at is None:
            continue
        tree[()] += n
        below = [f for f in frames[at + 1:] if not f.startswith("0x")]
        for d in range(1, min(depth, len(below)) + 1):
            tree[tuple(below[:d])] += n
    return tree


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--under", default="", help="print the tree below the first frame starting with this")
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--min", type=int, default=5, help="leave out tree nodes with fewer samples")
    ap.add_argument("--top", type=int, default=15, help="frames listed per thread")
    args = ap.parse_args()
    rows = list(read(args.raw))
    if args.under:
        tree = tree_under(rows, args.under, args.depth)
        print(f"{tree[()]} samples under {args.under}")
        for path, n in sorted(tree.items()):
            if path and n >= args.min:
                print(f"{n:7d} {100 * n / tree[()]:5.1f}% " + "  " * (len(path) - 1) + path[-1][:120])
        return
    for (process, thread), (total, frames) in sorted(per_thread(rows).items(), key=lambda kv: -kv[1][0]):
        print(f"== {process[:60]} / {thread}: {total} samples")
        for f, n in frames.most_common(args.top):
            print(f"{n:7d} {100 * n / total:5.1f}% {f[:120]}")


if __name__ == "__main__":
    main()
