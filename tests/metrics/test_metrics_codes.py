"""The gRPC codes a rank's /metrics counts equal the codes its clients saw (issue 30): calls the
client cancelled or gave up on at its deadline are not counted OK, every call is counted once.

A 2-rank group with a long batch deadline: OK lookups on both ranks; lookups whose rank-1 shard
is never sent, so that rank 0 parks them, either given up by a short grpcio deadline or
cancelled by the client once rank 0 has them. rank 0 sees each of those as a reset stream and
counts it CANCELLED (DEADLINE_EXCEEDED where the server itself answered so first), and the
answer it makes later, when the batch deadline passes, is not counted again."""
import collections
import sys
import time

import metricslib as ml

gl = ml.grouplib
SVC = "embps.v1.EmbeddingService"
BATCH_DEADLINE_S = 10.0
CLIENT_DEADLINE_S = 1.0  # far below the batch deadline; long enough to reach a loaded server
WAIT_S = 60.0


def lookup_counts(url):
    """(started, {grpc_code: handled}, histogram count) of the Lookup method on one rank."""
    smp, _ = ml.parse(ml.scrape(url))
    started, handled, seconds = 0, collections.Counter(), 0
    for (name, labels), v in smp.items():
        ls = dict(labels)
        if ls.get("grpc_service") != SVC or ls.get("grpc_method") != "Lookup":
            continue
        if name == "grpc_server_started_total":
            started = int(v)
        elif name == "grpc_server_handled_total" and v:
            handled[ls["grpc_code"]] = int(v)
        elif name == "grpc_server_handling_seconds_count":
            seconds = int(v)
    return started, handled, seconds


def half_lookup(raw, timeout):
    """Rank 0's shard of a 2-shard lookup whose rank-1 shard is never sent (a future)."""
    return raw.stubs[0].Lookup.future(gl.pb.LookupRequest(
        table="t", batch_id=gl.next_batch_id(), shard_index=0, shard_count=2,
        tokens_per_batch=4, tokens=gl.np.arange(2, dtype="<i8").tobytes()), timeout=timeout)


def main():
    g, urls = ml.metrics_group(2, "--batch-deadline-ms", str(int(BATCH_DEADLINE_S * 1000)))
    raw = gl.RawClient(g.addresses)
    seen = collections.Counter()  # the codes the client saw, rank 0's calls
    try:
        raw.create("t", 100, 8, "sgd")
        for _ in range(4):
            raw.lookup("t", list(range(8)), 8)
            seen["OK"] += 1
        last_parked = time.monotonic()
        for _ in range(3):  # given up by the client's deadline
            f = half_lookup(raw, CLIENT_DEADLINE_S)
            e = gl.rpc_error(f.result)
            assert e is not None and e.code() == gl.SC.DEADLINE_EXCEEDED, e
            seen["DeadlineExceeded"] += 1
            last_parked = time.monotonic()
        for _ in range(3):  # cancelled by the client once rank 0 has the call
            want = sum(seen.values()) + 1
            f = half_lookup(raw, gl.CALL_TIMEOUT)
            assert ml.wait_for(lambda: lookup_counts(urls[0])[0] == want, WAIT_S), \
                "rank 0 never started the call: %s" % (lookup_counts(urls[0]),)
            assert f.cancel(), "the call ended before it was cancelled: %s" % f.code()
            assert f.code() == gl.SC.CANCELLED, f.code()
            seen["Canceled"] += 1
            last_parked = time.monotonic()

        def settled(url):
            started, handled, seconds = lookup_counts(url)
            return sum(handled.values()) == started == seconds

        assert ml.wait_for(lambda: settled(urls[0]), WAIT_S), lookup_counts(urls[0])
        check(urls, seen)
        # Rank 0 answers the parked shards when the batch deadline passes: nothing counted again.
        time.sleep(max(0.0, last_parked + BATCH_DEADLINE_S + 2.0 - time.monotonic()))
        check(urls, seen)
    finally:
        raw.close()
        codes = g.close()
    assert all(c == 0 for c in codes.values()), "exit codes %s\n%s" % (codes, g.last_logs)
    print("ok: the codes counted equal the codes the client saw: %s" % dict(seen))
    return 0


def check(urls, seen):
    started, handled, seconds = lookup_counts(urls[0])
    given_up = seen["DeadlineExceeded"] + seen["Canceled"]
    assert started == sum(seen.values()) == seconds, (started, seen, seconds)
    # A call the client gave up on counts CANCELLED, or DEADLINE_EXCEEDED where the server
    # answered so before the reset; never OK.
    assert handled["OK"] == seen["OK"], (handled, seen)
    assert handled["Canceled"] + handled["DeadlineExceeded"] == given_up, (handled, seen)
    assert handled["Canceled"] >= seen["Canceled"], (handled, seen)
    assert sum(handled.values()) == started, (handled, started)
    started1, handled1, _ = lookup_counts(urls[1])
    assert started1 == seen["OK"] and handled1 == {"OK": seen["OK"]}, (started1, handled1)


if __name__ == "__main__":
    sys.exit(main())
