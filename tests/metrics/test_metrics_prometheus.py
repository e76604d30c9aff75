"""A real Prometheus server (Debian's, started here on a free loopback port with its own config
and data directory) scrapes a 2-rank group's /metrics; after a short `embps bench`, its query
API returns the expected series for both ranks and nonzero rates. Bounded waits; the group and
Prometheus are stopped whatever happens."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import metricslib as ml


def query(base, expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read().decode())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_query(base, expr, pred, timeout=40):
    """Polls expr until pred(result) holds; returns the result, or raises with the last one."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = query(base, expr)
            if pred(last):
                return last
        except (OSError, ValueError) as e:
            last = repr(e)
        time.sleep(0.5)
    raise AssertionError("%s: never as expected; last: %s" % (expr, last))


def main():
    prom = ml.need("prometheus")
    work = tempfile.mkdtemp(prefix="embps-prom-")
    g = proc = log = None
    try:
        g, urls = ml.metrics_group(2)
        targets = [u[len("http://"):-len("/metrics")] for u in urls]
        port = ml.grouplib.free_ephemeral_port()
        with open(os.path.join(work, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "scrape_configs:\n  - job_name: embps\n    static_configs:\n"
                    "      - targets: [%s]\n" % ", ".join("'%s'" % t for t in targets))
        log = open(os.path.join(work, "prometheus.log"), "w+")
        proc = subprocess.Popen([prom, "--config.file", os.path.join(work, "prometheus.yml"),
                                 "--storage.tsdb.path", os.path.join(work, "data"),
                                 "--web.listen-address", "127.0.0.1:%d" % port],
                                stdout=log, stderr=subprocess.STDOUT)
        base = "http://127.0.0.1:%d" % port
        try:
            wait_query(base, "up", lambda r: len(r) == 2 and all(x["value"][1] == "1" for x in r))
        except AssertionError:
            log.seek(0)
            raise AssertionError("Prometheus did not scrape both ranks; its log:\n" +
                                 log.read()[-3000:])
        ml.cli(g.servers, "create-table", "items", "--rows", "10000", "--emb-width", "16")
        ml.cli(g.servers, "bench", "items", "--batch", "256", "--duration", "2",
               "--concurrency", "2", "--push-ratio", "0.5", timeout=60)
        two = lambda r: len(r) == 2  # noqa: E731
        positive = lambda r: len(r) == 2 and all(float(x["value"][1]) > 0 for x in r)  # noqa
        wait_query(base, 'embps_table_lookups_total{table="items"} > 0', two)
        wait_query(base, 'embps_group_size == 2', two)
        wait_query(base, 'sum by (instance) (rate(grpc_server_handled_total{grpc_method="Lookup",'
                         'grpc_code="OK"}[10s]))', positive)
        wait_query(base, 'sum by (instance) (rate(embps_table_rows_pushed_total[10s]))', positive)
        wait_query(base, 'rate(embps_group_peer_sent_bytes_total[10s])', positive)
        wait_query(base, 'histogram_quantile(0.9, sum by (le, instance) (rate('
                         'grpc_server_handling_seconds_bucket{grpc_method="Lookup"}[10s])))',
                   positive)
        wait_query(base, 'sum by (instance) (rate(embps_round_phase_seconds_count{'
                         'phase="collectives"}[10s]))', positive)
        # The CLI's one-off view of both ranks: valid exposition, every sample with its rank.
        text = ml.cli(g.servers, "stats", "--prometheus")
        ok, why = ml.promtool_check(text)
        assert ok, "promtool on the 2-rank `embps stats --prometheus`:\n%s" % why
        smp, _ = ml.parse(text)
        assert ml.value(smp, "embps_group_rank", rank="1") == 1
        assert all(dict(ls).get("rank") in ("0", "1") for _, ls in smp)
        ranks = query(base, "embps_group_rank")
        assert sorted(x["value"][1] for x in ranks) == ["0", "1"], ranks
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log:
            log.close()
        if g:
            g.close()
        shutil.rmtree(work, ignore_errors=True)
    print("ok: Prometheus scraped both ranks and answers for the bench's series")
    return 0


if __name__ == "__main__":
    sys.exit(main())
