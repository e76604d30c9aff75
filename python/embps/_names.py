"""The proto's enum numbers under the names the library's callers write ("f32", "adam", "sync"),
and the numpy dtype of each row format on the wire.

They are read from the descriptors of proto/ (_stubs.py) at import, so a renumbered enum value
is followed here; values.py keeps its own small number -> name maps for the plain values it
builds, and those are checked against the proto here, so a change that values.py does not
follow fails at import instead of mislabelling a table.
"""
import numpy as np

from . import _stubs
from .values import DTYPES, EVICTIONS, OPTIMIZERS

pb = _stubs.messages()
_DTYPE = pb.enum("embps.v1.DType")
_OPT = pb.enum("embps.v1.OptimizerKind")
_MODE = pb.enum("embps.v1.UpdateMode")
_EVICTION = pb.enum("embps.v1.Eviction")
_SERVING = pb.enum("grpc.health.v1.HealthCheckResponse.ServingStatus")
_POOLING = pb.enum("embps.v1.Pooling")

F32, BF16 = _DTYPE["DTYPE_F32"], _DTYPE["DTYPE_BF16"]
if DTYPES != {F32: "f32", BF16: "bf16"} or any(
        OPTIMIZERS[_OPT["OPTIMIZER_" + n.upper()]] != n
        for n in ("sgd", "adagrad", "rowwise_adagrad", "adam")):
    raise ImportError("embps: the DType or OptimizerKind numbers in proto/ changed: update "
                      "embps/values.py")
if any(EVICTIONS[_EVICTION["EVICTION_" + n.upper()]] != n for n in ("lru", "lfu", "ttl")) or \
        EVICTIONS[_EVICTION["EVICTION_UNSPECIFIED"]] != "lru":
    raise ImportError("embps: the Eviction numbers in proto/ changed: update embps/values.py")

DTYPE_NAMES = {"f32": F32, "float32": F32, "bf16": BF16, "bfloat16": BF16}
OPTIMIZER_NAMES = {"sgd": _OPT["OPTIMIZER_SGD"], "adagrad": _OPT["OPTIMIZER_ADAGRAD"],
                   "rowwise_adagrad": _OPT["OPTIMIZER_ROWWISE_ADAGRAD"],
                   "adam": _OPT["OPTIMIZER_ADAM"], None: _OPT["OPTIMIZER_UNSPECIFIED"],
                   "default": _OPT["OPTIMIZER_UNSPECIFIED"]}
EVICTION_NAMES = {"lru": _EVICTION["EVICTION_LRU"], "lfu": _EVICTION["EVICTION_LFU"],
                  "ttl": _EVICTION["EVICTION_TTL"], None: _EVICTION["EVICTION_UNSPECIFIED"]}
# Feature batches' pooling modes (embps.Feature's pooling=), by the names the library takes.
POOLING_NAMES = {"none": _POOLING["POOLING_NONE"], "sum": _POOLING["POOLING_SUM"],
                 "mean": _POOLING["POOLING_MEAN"],
                 "weighted_sum": _POOLING["POOLING_WEIGHTED_SUM"]}
MODES = {"sync": _MODE["UPDATE_MODE_SYNC"], "async": _MODE["UPDATE_MODE_ASYNC"]}
ITEMSIZE = {F32: 4, BF16: 2}
NP_DTYPE = {F32: np.dtype("<f4"), BF16: np.dtype("<u2")}
STATUS_NAMES = {v: k for k, v in _SERVING.items()}
