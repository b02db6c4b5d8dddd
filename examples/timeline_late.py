"""Which rank holds the negotiations up? From a HOROVOD_TIMELINE file, where rank 0 marks
each rank's submission of each tensor (an instant event named by the rank) inside the
tensor's NEGOTIATE span, per kind of tensor (ZeRO's parameter gathers, gradient reductions,
the rest):

    negotiations   how many were negotiated
    spread         last rank's submission minus the first's (median, 90th percentile), ms
    last           per rank, how often it submitted last (ties count for each), and its
                   median lag behind the first rank when it was last, ms

A rank that is last far more often than the others, by milliseconds, is the one to look at
(its host runs behind); a spread under a millisecond, shared evenly among the ranks, is noise.

    HOROVOD_TIMELINE=tl.json torchrun ... ; python examples/timeline_late.py tl.json [--skip 2]

--skip N drops the negotiations of each tensor's first N rounds (warm-up steps). Rounds that
lack a rank's mark (it submitted before the timeline began, or had joined) are left out.
"""
import argparse
import collections
import json
import statistics


def kind_of(name):
    if ".param." in name:
        return "parameter gathers"
    if ".grad." in name:
        return "gradient reductions"
    return "other"


def negotiations(events, skip=0):
    """[(tensor, {rank: submission time})] per NEGOTIATE span that holds rank marks, in
    microseconds, without each tensor's first `skip` rounds."""
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    marks = collections.defaultdict(list)
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "i" and e.get("tid") in tracks:
            marks[e["tid"]].append((e["ts"], int(e["name"])))
        elif e.get("ph") == "X" and e.get("name") == "NEGOTIATE":
            spans[e["tid"]].append(e["ts"] + e["dur"])
    out = []
    for tid, ends in spans.items():
        pending = sorted(marks.get(tid, []))
        rounds = []
        for end in sorted(ends):
            # The marks up to the negotiation's end are its own (a rank submits a name
            # again only after its last op of that name was negotiated).
            mine = {}
            while pending and pending[0][0] <= end + 1.0:
                ts, rank = pending.pop(0)
                mine.setdefault(rank, ts)
            if mine:
                rounds.append(mine)
        out += [(tracks[tid], r) for r in rounds[skip:]]
    return out


def summarize(rounds):
    """Per kind: count, spread median and p90 (ms), and per rank (times last, median lag ms)."""
    by_kind = collections.defaultdict(list)
    ranks = max((len(at) for _, at in rounds), default=0)
    for name, at in rounds:
        if len(at) == ranks:
            by_kind[kind_of(name)].append(at)
    table = {}
    for kind, rs in sorted(by_kind.items()):
        spreads = sorted((max(a.values()) - min(a.values())) / 1e3 for a in rs)
        last = collections.defaultdict(list)
        for a in rs:
            latest = max(a.values())
            for rank, ts in a.items():
                if len(a) > 1 and ts == latest:
                    last[rank].append((ts - min(a.values())) / 1e3)
        table[kind] = {
            "negotiations": len(rs),
            "spread_median_ms": statistics.median(spreads),
            "spread_p90_ms": spreads[int(0.9 * (len(spreads) - 1))],
            "last": {rank: (len(lags), statistics.median(lags)) for rank, lags in sorted(last.items())},
        }
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline")
    ap.add_argument("--skip", type=int, default=0, help="each tensor's first N negotiations left out")
    args = ap.parse_args()
    with open(args.timeline) as f:
        events = json.load(f)
    table = summarize(negotiations(events, args.skip))
    if not table:
        print("no rank marks: the timeline predates them, or no tensor was negotiated")
    for kind, row in table.items():
        lasts = ", ".join(f"rank {r} {n}x ({lag:.2f} ms)" for r, (n, lag) in row["last"].items())
        print(f"{kind}: {row['negotiations']} negotiations, spread median {row['spread_median_ms']:.2f} ms, "
              f"p90 {row['spread_p90_ms']:.2f} ms; last to submit: {lasts}")


if __name__ == "__main__":
    main()
