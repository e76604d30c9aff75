"""A running server's /metrics after known work: promtool accepts it, and the counters equal
what was done (gRPC calls by method and code, table lookups and pushes, rows, steps applied and
skipped, rounds, the checkpoint). `embps stats --prometheus` prints the same series."""
import math
import shutil
import sys
import tempfile
import urllib.error
import urllib.request

import metricslib as ml


def main():
    ml.need("promtool")
    ckpt = tempfile.mkdtemp(prefix="embps-metrics-")
    g, urls = ml.metrics_group(1, "--checkpoint-dir", ckpt)
    try:
        s = g.servers
        ml.cli(s, "create-table", "items", "--rows", "1000", "--emb-width", "8")
        for _ in range(3):
            ml.cli(s, "lookup", "items", "--tokens", "1,2,3,2")
        ml.cli(s, "push", "items", "--tokens", "1,2", "--grad-value", "0.1")
        raw = ml.grouplib.RawClient(g.addresses)  # a non-finite gradient: the gate skips it
        try:
            grads = ml.grouplib.np.full((3, 8), float("nan"), dtype="float32")
            raw.push("items", [4, 5, 6], grads)
            # 4096 x 8 f32 (128 KiB): a large message, read in place
            big = [i % 999 + 1 for i in range(4096)]
            raw.push("items", big, ml.grouplib.np.full((4096, 8), 0.01, dtype="float32"))
            _, futs = raw.lookup_async("missing", [1])  # an error code is counted too
            assert ml.grouplib.rpc_error(lambda: [f.result() for f in futs]) is not None
        finally:
            raw.close()
        out = ml.cli(s, "checkpoint")
        round_no = int(out.split("round ")[1].split(",")[0])

        text = ml.scrape(urls[0])
        ok, why = ml.promtool_check(text)
        assert ok, "promtool check metrics failed:\n%s\n%s" % (why, text)
        smp, types = ml.parse(text)
        for name in types:  # every family has HELP and TYPE
            assert "# HELP %s " % name in text, name
        v = lambda name, **kw: ml.value(smp, name, **kw)  # noqa: E731
        svc = "embps.v1.EmbeddingService"
        assert v("grpc_server_handled_total", grpc_service=svc, grpc_method="Lookup",
                 grpc_code="OK") == 3
        assert v("grpc_server_handled_total", grpc_service=svc, grpc_method="Lookup",
                 grpc_code="NotFound") == 1
        assert v("grpc_server_started_total", grpc_service=svc, grpc_method="Lookup") == 4
        assert v("grpc_server_handled_total", grpc_service=svc, grpc_method="PushGradients",
                 grpc_code="OK") == 3
        assert v("grpc_server_handling_seconds_count", grpc_service=svc,
                 grpc_method="PushGradients") == 3
        assert v("grpc_server_handling_seconds_bucket", grpc_service=svc,
                 grpc_method="Lookup", le="+Inf") == 4
        assert v("embps_table_lookups_total", table="items") == 3
        assert v("embps_table_rows_looked_up_total", table="items") == 12
        assert v("embps_table_pushes_total", table="items") == 3
        assert v("embps_table_rows_pushed_total", table="items") == 5 + 4096
        assert v("embps_table_steps_applied_total", table="items") == 2
        assert v("embps_table_steps_skipped_total", table="items") == 1
        assert v("embps_table_rows", table="items") == 1000
        assert v("embps_table_unique_tokens_per_batch_count", table="items") == 3  # the pushes
        assert v("embps_table_unique_tokens_per_batch_sum", table="items") == 5 + 999
        assert v("embps_table_bytes", table="items") > 0
        assert v("embps_memory_bytes", kind="tables_host") == v("embps_table_bytes", table="items")
        assert v("embps_rounds_total") == 6 and v("embps_round_batches_total") == 6
        assert v("embps_round_phase_seconds_count", phase="compute") == 6
        assert v("embps_group_size") == 1 and v("embps_group_ready") == 1
        for name in ("embps_group_batches_expired_total", "embps_group_batches_cancelled_total",
                     "embps_group_shards_withdrawn_total",
                     "embps_group_retries_deduplicated_total"):
            assert v(name) == 0, name  # nothing expired, left or was retried here
        assert v("embps_group_backend_info", backend="cpu") == 1
        assert v("embps_checkpoint_last_round") == round_no
        assert v("embps_checkpoints_completed_total") == 1
        assert v("embps_checkpoint_duration_seconds_count") == 1
        assert v("embps_checkpoint_written_bytes_total") > 0
        assert v("embps_connections") >= 0 and v("embps_message_received_bytes_total") > 0
        assert math.isfinite(v("process_start_time_seconds"))
        # Other paths are not served.
        try:
            urllib.request.urlopen(urls[0].replace("/metrics", "/other"), timeout=5)
            raise AssertionError("/other was served")
        except urllib.error.HTTPError as e:
            assert e.code == 404, e.code

        # The CLI prints the same series (one more GetStats call counted since).
        cli_text = ml.cli(s, "stats", "--prometheus")
        ok, why = ml.promtool_check(cli_text)
        assert ok, "promtool on `embps stats --prometheus`:\n%s\n%s" % (why, cli_text)
        csmp, _ = ml.parse(cli_text)
        assert ml.value(csmp, "embps_table_lookups_total", table="items") == 3
        assert set(n for n, _ in csmp) == set(n for n, _ in smp), \
            set(n for n, _ in csmp) ^ set(n for n, _ in smp)

        # A lookup of 20000 tokens x 8 f32 takes a 640 KB reply buffer from the pool (larger
        # than any it holds yet), which keeps it: counted, and pageable on the CPU backend.
        assert v("embps_memory_bytes", kind="buffers_pinned") == 0
        before = v("embps_memory_bytes", kind="buffers_host")
        raw = ml.grouplib.RawClient(g.addresses)
        try:
            raw.lookup("items", [i % 1000 for i in range(20000)], 8)
        finally:
            raw.close()
        bsmp, _ = ml.parse(ml.scrape(urls[0]))
        after = ml.value(bsmp, "embps_memory_bytes", kind="buffers_host")
        assert after >= before + 640000, (before, after)
        assert ml.value(bsmp, "embps_memory_bytes", kind="buffers_pinned") == 0
    finally:
        g.close()
        shutil.rmtree(ckpt, ignore_errors=True)
    print("ok: /metrics passes promtool and counts what was done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
