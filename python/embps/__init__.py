"""embps: the Python worker library of the embps embedding parameter server.

    import embps
    with embps.Client("127.0.0.1:7070,127.0.0.1:7071") as c:   # or EMBPS_SERVERS
        c.create_table("items", rows=1_000_000, emb_width=128, optimizer="rowwise_adagrad",
                       lr=0.01)
        rows = c.lookup("items", tokens)               # (len(tokens), 128) float32
        res = c.push("items", tokens, grads)           # PushResult(applied, grad_norm, ...)
        fut = c.lookup_async("items", next_tokens)     # a concurrent.futures.Future
        rows = fut.result()
        feats = {"hist": embps.Feature("items", ids, lengths, pooling="mean")}
        pooled = c.lookup_features(feats)["hist"]     # (samples, 128), pooled on the servers
        c.push_features(feats, {"hist": grad})        # one step per table
        c.assign("items", tokens, rows)                # rows written as given
        c.import_array("items", np.load("items.npy", mmap_mode="r"))  # a warm start

Pure Python over stock grpcio, numpy and protobuf: the message classes are built at first import
from proto/ (see embps/_stubs.py for where the .proto files and the cache are looked for).
embps.checkpoint reads a checkpoint's tables as numpy arrays, offline (no server):
embps.checkpoint.open("/data/ckpt")["items"].rows[:1000].

Errors: embps.Error (a failed call: .code, a grpc.StatusCode, and the server's message) and
embps.ShapeError (an Error and a ValueError: a batch or table that does not split over the
group, refused before anything is sent, with the same words as the C client and the servers).
"""
from . import checkpoint
from ._features import Feature
from .client import BatchFuture, Client, parse_servers
from .errors import Error, ShapeError
from .values import (AssignResult, CheckpointInfo, Health, ImportResult, PushFeaturesResult,
                     PushResult, RankStats, TableSpec, TableStats, TableStep)

__all__ = ["Client", "BatchFuture", "Error", "ShapeError", "TableSpec", "PushResult",
           "RankStats", "TableStats", "Health", "CheckpointInfo", "parse_servers", "Feature",
           "PushFeaturesResult", "TableStep", "AssignResult", "ImportResult", "checkpoint"]
__version__ = "0.1.0"
