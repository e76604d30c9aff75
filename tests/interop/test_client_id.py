"""libembps sends its client id (issue 12 item 6), seen by a real gRPC server.

Two grpcio servers stand in for a 2-rank group (ListTables says so) and record every
LookupRequest and PushGradientsRequest they receive. The `embps` CLI, which uses libembps, looks
up and pushes against them from two separate processes. Every shard of one batch must carry the
same non-zero client_id and batch_id (the servers join a batch's shards by that pair), one
process must keep one client_id, and the two processes must differ: without the id, two
clients that pick the same batch_id fail each other with 'already in flight'.
"""
import os
import subprocess
import sys
import threading
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import embps_testlib as lib  # noqa: E402
import grpc  # noqa: E402

pb = lib.embps_pb2
WIDTH = 4


def cli_binary():
    return os.environ.get("EMBPS_CLI_BIN", os.path.join(lib.ROOT, "build", "bin", "embps"))


class Recorder(lib.embps_pb2_grpc.EmbeddingServiceServicer):
    """One fake rank: a 2-rank group holding table 't' (100 x 4 f32, rows of zeros)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen = []  # (kind, client_id, batch_id, shard_index)

    def ListTables(self, request, context):
        spec = pb.TableSpec(name="t", rows=100, emb_width=WIDTH, dtype=pb.DTYPE_F32)
        return pb.ListTablesResponse(tables=[spec], group_size=2)

    def Lookup(self, request, context):
        with self.lock:
            self.seen.append(("lookup", request.client_id, request.batch_id, request.shard_index))
        n = len(request.tokens) // 8
        return pb.LookupResponse(batch_id=request.batch_id, shard_index=request.shard_index,
                                 emb_width=WIDTH, dtype=pb.DTYPE_F32, rows=bytes(n * WIDTH * 4))

    def PushGradients(self, request, context):
        with self.lock:
            self.seen.append(("push", request.client_id, request.batch_id, request.shard_index))
        return pb.PushGradientsResponse(batch_id=request.batch_id, shard_index=request.shard_index)


def start(recorder):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    lib.embps_pb2_grpc.add_EmbeddingServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, "127.0.0.1:%d" % port


def run_cli(servers, *args):
    p = subprocess.run([cli_binary(), "--servers", servers, *args], capture_output=True,
                       text=True, timeout=60)
    if p.returncode != 0:
        raise AssertionError("embps %s failed (%d): %s" % (" ".join(args), p.returncode, p.stderr))


def main():
    ranks = [Recorder(), Recorder()]
    servers = [start(r) for r in ranks]
    addresses = ",".join(a for _, a in servers)
    try:
        # Process A: one lookup and one push (two batches); process B: one lookup.
        run_cli(addresses, "lookup", "t", "--tokens", "1,2,3,4")
        run_cli(addresses, "push", "t", "--tokens", "5,6", "--grad-value", "0.5")
        a_calls = [list(r.seen) for r in ranks]
        for r in ranks:
            r.seen.clear()
        run_cli(addresses, "lookup", "t", "--tokens", "7,8")
        b_calls = [list(r.seen) for r in ranks]
        for r in ranks:
            r.seen.clear()
        # One bench thread is one client: many batches, one client id, distinct batch ids.
        run_cli(addresses, "bench", "t", "--batch", "4", "--duration", "0.5", "--warmup", "0",
                "--concurrency", "1", "--push-ratio", "0.5", "--output", "json")
        c_calls = [list(r.seen) for r in ranks]
    finally:
        for s, _ in servers:
            s.stop(None)

    def batches(calls):
        """{(kind, client_id, batch_id): sorted shard indexes over both ranks}"""
        out = {}
        for rank_calls in calls:
            for kind, cid, bid, shard in rank_calls:
                out.setdefault((kind, cid, bid), []).append(shard)
        return {k: sorted(v) for k, v in out.items()}

    # The CLI's lookup and push are separate processes: the push batch comes from another client.
    a, b = batches(a_calls), batches(b_calls)
    for name, got in (("first", a), ("second", b)):
        assert got, "%s run: the servers saw no request" % name
        for (kind, cid, bid), shards in got.items():
            assert cid != 0, "%s run: a %s shard carried no client_id" % (name, kind)
            assert shards == [0, 1], \
                "%s run: batch (%x, %d) of %s arrived as shards %s, not one per rank" % (
                    name, cid, bid, kind, shards)
    lookup_a = {cid for kind, cid, _ in a if kind == "lookup"}
    push_a = {cid for kind, cid, _ in a if kind == "push"}
    lookup_b = {cid for kind, cid, _ in b}
    assert len(lookup_a) == 1 and len(push_a) == 1 and len(lookup_b) == 1, (a, b)
    assert len(lookup_a | push_a | lookup_b) == 3, \
        "three client processes shared a client_id: %s" % (lookup_a | push_a | lookup_b)
    c = batches(c_calls)
    assert len(c) >= 4, "the bench made only %d batches" % len(c)
    assert len({cid for _, cid, _ in c}) == 1, "one bench client sent several client ids"
    assert 0 not in {cid for _, cid, _ in c}
    assert len({bid for _, _, bid in c}) == len(c), "the bench client reused a batch_id"
    assert all(shards == [0, 1] for shards in c.values()), c
    print("bench: %d batches from one client id" % len(c))
    print("ok: 3 CLI processes, 3 distinct non-zero client ids, every batch's shards agree")


if __name__ == "__main__":
    main()
