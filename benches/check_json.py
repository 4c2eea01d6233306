#!/usr/bin/env python3
"""Checks a fabric-bench --json file: the shape CI and readers rely on.

usage: python3 benches/check_json.py FILE

Fails (exit 1, with the reasons) unless the file is a JSON object with a non-empty string
`provider` and a non-empty list `results`; every result has a string `test`; every bw row has
`engine_gbps`, `baseline_gbps` and `ratio` (numbers, or null where a figure is missing), and
where it names them a `pattern` ("hot" or "cold") and `domains` (a whole number above 0); every
row with a `fabtests` string (the fabtests command, or "skipped: ...") has
`fabtests_<unit>`, `ratio_engine_fabtests` and `ratio_raw_fabtests` (numbers or null); and at
least one bw row has a finite, positive ratio. A `fabric-bench moe --json` file has moe rows
instead: each has `engine_us`, `baseline_us` and `ratio` (numbers or null); no bw row needed.
"""

import json
import math
import sys


def num_or_null(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def check_fabtests(i, r):
    """The fabtests columns of one row."""
    errs = []
    if not isinstance(r["fabtests"], str) or not r["fabtests"]:
        errs.append(f"results[{i}] ({r.get('case')}): fabtests {r['fabtests']!r}, not a non-empty string")
    units = [k[len("engine_"):] for k in r if k.startswith("engine_")]
    keys = [f"fabtests_{u}" for u in units] + ["ratio_engine_fabtests", "ratio_raw_fabtests"]
    for k in keys:
        if k not in r:
            errs.append(f"results[{i}] ({r.get('case')}): no '{k}' beside 'fabtests'")
        elif not num_or_null(r[k]):
            errs.append(f"results[{i}] ({r.get('case')}): '{k}' is {r[k]!r}, not a number or null")
    return errs


def check_rounds(i, r):
    """A median of per-round figures (bw's and rtt's `engine_x` rows): `rounds`, `range` and
    `ci95` (null under 6 rounds), the CI inside the range and around the median."""
    errs, case = [], r.get("case")
    n, rng, ci, m = r.get("rounds"), r.get("range"), r.get("ci95", "absent"), r.get("engine_x")
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        return [f"results[{i}] ({case}): rounds {n!r}, not a whole number above 1"]
    pair = lambda p: isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) for x in p)
    if not pair(rng) or rng[0] > rng[1]:
        return [f"results[{i}] ({case}): range {rng!r}, not [lo, hi]"]
    if n < 6:
        if ci is not None:
            errs.append(f"results[{i}] ({case}): ci95 {ci!r} from {n} rounds (want null under 6)")
    elif not pair(ci) or not (rng[0] <= ci[0] <= ci[1] <= rng[1]):
        errs.append(f"results[{i}] ({case}): ci95 {ci!r} is not an interval inside range {rng!r}")
    elif isinstance(m, (int, float)) and not (ci[0] - 1e-9 <= m <= ci[1] + 1e-9):
        errs.append(f"results[{i}] ({case}): median {m!r} outside ci95 {ci!r}")
    return errs


def check(doc):
    errs = []
    if not isinstance(doc, dict):
        return ["the top level is not an object"]
    prov = doc.get("provider")
    if not isinstance(prov, str) or not prov:
        errs.append(f"provider: want a non-empty string, got {prov!r}")
    results = doc.get("results")
    if not isinstance(results, list) or not results:
        errs.append("results: want a non-empty list")
        return errs
    bw, moe, good = 0, 0, []
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("test"), str):
            errs.append(f"results[{i}]: want an object with a string 'test', got {r!r}")
            continue
        if "fabtests" in r:
            errs += check_fabtests(i, r)
        if "engine_x" in r:
            errs += check_rounds(i, r)
            continue
        if r["test"] == "moe":
            moe += 1
            for k in ("engine_us", "baseline_us", "ratio"):
                if k not in r:
                    errs.append(f"results[{i}] ({r.get('case')}): no '{k}'")
                elif not num_or_null(r[k]):
                    errs.append(f"results[{i}] ({r.get('case')}): '{k}' is {r[k]!r}, not a number or null")
            continue
        if r["test"] != "bw":
            continue
        bw += 1
        for k in ("engine_gbps", "baseline_gbps", "ratio"):
            if k not in r:
                errs.append(f"results[{i}] ({r.get('case')}): no '{k}'")
            elif not num_or_null(r[k]):
                errs.append(f"results[{i}] ({r.get('case')}): '{k}' is {r[k]!r}, not a number or null")
        if "pattern" in r and r["pattern"] not in ("hot", "cold"):
            errs.append(f"results[{i}] ({r.get('case')}): pattern {r['pattern']!r}, not hot or cold")
        d = r.get("domains", 1)
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            errs.append(f"results[{i}] ({r.get('case')}): domains {d!r}, not a whole number above 0")
        ratio = r.get("ratio")
        if isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 0:
            good.append(f"{r.get('case')} {ratio:.2f}")
    if bw == 0 and moe > 0:
        if not errs:
            print(f"json ok: provider {prov}, {len(results)} moe results")
        return errs
    if bw == 0:
        errs.append("no bw row")
    elif not good:
        errs.append("no bw row with a finite, positive ratio")
    if not errs:
        print(f"json ok: provider {prov}, {len(results)} results, bw ratios: {', '.join(good)}")
    return errs


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2])
    path = sys.argv[1]

    def reject(tok):
        raise ValueError(f"{tok} is not JSON")

    try:
        with open(path) as f:
            doc = json.load(f, parse_constant=reject)
    except (OSError, ValueError) as e:
        sys.exit(f"{path}: {e}")
    errs = check(doc)
    if errs:
        print(f"{path}: not a valid fabric-bench report:", file=sys.stderr)
        for e in errs:
            print(f"  {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
