"""deploy/grafana/embps.json names only metrics the server exports: every PromQL expression of
the dashboard (panel targets and template queries) is parsed for metric names, which must all
appear in a real scrape of a server that has served lookups and pushes and taken a checkpoint.
The server holds a dense table and a full hash-keyed one (admission, eviction, dropped
gradients), and the dashboard must chart every hash-keyed table family: a family missing from
the dashboard fails, as does a hash-keyed panel that sums the replicated figures over ranks."""
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
# The families a hash-keyed table adds (server/metrics/metrics.c): the dashboard charts them all.
HASH_FAMILIES = {
    "embps_table_capacity", "embps_table_keys", "embps_table_keys_admitted_total",
    "embps_table_keys_evicted_total", "embps_table_keys_expired_total",
    "embps_table_keys_refused_total", "embps_table_gradients_dropped_total"}


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
        # Capacity 4, a key stored at its second push step: the first push drops every
        # gradient, the second admits 4 of 8 keys and refuses the rest (every slot holds a key
        # of that step), the third (new keys) evicts.
        ml.cli(g.servers, "create-table", "users", "--capacity", "4", "--emb-width", "8",
               "--admit-after", "2")
        for toks in ("1,2,3,4,5,6,7,8", "1,2,3,4,5,6,7,8", "9,10,11,12", "9,10,11,12"):
            ml.cli(g.servers, "push", "users", "--tokens", toks, "--grad-value", "0.1")
        ml.cli(g.servers, "lookup", "users", "--tokens", "9,99")
        ml.cli(g.servers, "checkpoint")
        samples, _ = ml.parse(ml.scrape(urls[0]))
    finally:
        g.close()
        shutil.rmtree(ckpt, ignore_errors=True)
    exported = {n for n, _ in samples}
    assert HASH_FAMILIES <= exported, HASH_FAMILIES - exported
    hv = {n: ml.value(samples, n, table="users") for n in HASH_FAMILIES}
    assert hv["embps_table_capacity"] == 4 and hv["embps_table_keys"] == 4, hv
    for n in ("embps_table_keys_admitted_total", "embps_table_keys_evicted_total",
              "embps_table_keys_refused_total", "embps_table_gradients_dropped_total"):
        assert hv[n] > 0, (n, hv)
    all_exprs = list(exprs(dash))
    assert len(all_exprs) >= 15, len(all_exprs)
    missing = {}
    for e in all_exprs:
        used = names(e)
        assert used, "no metric found in %r" % e
        for n in used - exported:
            missing.setdefault(n, []).append(e)
    assert not missing, "the dashboard names metrics the server does not export: %s" % missing
    charted = set().union(*(names(e) for e in all_exprs))
    assert HASH_FAMILIES <= charted, "no panel charts %s" % sorted(HASH_FAMILIES - charted)
    # Every rank reports a hash-keyed table's figures alike (the key index is replicated), so
    # a panel over them aggregates per table with max, never sum (which would count N times).
    for e in all_exprs:
        if names(e) & HASH_FAMILIES:
            assert "by (table)" in e and not re.search(r"\bsum\b", e), \
                "hash-keyed table expression must be max by (table): %r" % e
    print("ok: %d dashboard expressions name only exported metrics" % len(all_exprs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
