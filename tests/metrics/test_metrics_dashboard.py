"""deploy/grafana/embps.json names only metrics the server exports: every PromQL expression of
the dashboard (panel targets and template queries) is parsed for metric names, which must all
appear in a real scrape of a server that has served lookups and pushes and taken a checkpoint."""
import json
import os
import re
import shutil
import sys
import tempfile

import metricslib as ml

ROOT = os.path.dirname(os.path.dirname(ml.HERE))
FUNCS = {  # PromQL functions, aggregations and keywords, which look like names
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "and", "or", "unless", "offset", "rate", "irate", "increase", "delta", "idelta",
    "histogram_quantile", "time", "abs", "clamp_min", "clamp_max", "label_values", "vector",
    "scalar", "deriv", "predict_linear", "resets", "changes", "absent", "sort", "sort_desc",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "inf", "nan", "le"}


def exprs(dash):
    for p in dash.get("panels", []):
        for t in p.get("targets", []):
            yield t["expr"]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            m = re.match(r"label_values\((.*),\s*\w+\)$", v["query"])
            yield m.group(1) if m else v["query"]


def names(expr):
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    e = re.sub(r"\{[^}]*\}", "", e)                 # matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    found = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", e):
        w = m.group(0)
        after = e[m.end():].lstrip()
        if w in FUNCS or w.startswith("$") or after.startswith("("):
            continue
        if re.match(r"^\d", w):
            continue
        found.add(w)
    return found


def main():
    ml.need("promtool")  # the package this label is about; the scrape itself needs none
    with open(os.path.join(ROOT, "deploy", "grafana", "embps.json")) as f:
        dash = json.load(f)
    ckpt = tempfile.mkdtemp(prefix="embps-dash-")
    g, urls = ml.metrics_group(1, "--checkpoint-dir", ckpt)
    try:
        ml.cli(g.servers, "create-table", "items", "--rows", "100", "--emb-width", "8")
        ml.cli(g.servers, "lookup", "items", "--tokens", "1,2")
        ml.cli(g.servers, "push", "items", "--tokens", "1,2", "--grad-value", "0.1")
        ml.cli(g.servers, "checkpoint")
        samples, _ = ml.parse(ml.scrape(urls[0]))
    finally:
        g.close()
        shutil.rmtree(ckpt, ignore_errors=True)
    exported = {n for n, _ in samples}
    all_exprs = list(exprs(dash))
    assert len(all_exprs) >= 15, len(all_exprs)
    missing = {}
    for e in all_exprs:
        used = names(e)
        assert used, "no metric found in %r" % e
        for n in used - exported:
            missing.setdefault(n, []).append(e)
    assert not missing, "the dashboard names metrics the server does not export: %s" % missing
    print("ok: %d dashboard expressions name only exported metrics" % len(all_exprs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
