"""The bulk messages, LookupRequest/LookupResponse, PushGradientsRequest and AssignRequest, encoded
and decoded by hand; every other message goes through the protobuf classes of _stubs.

Why by hand: a 4096 x 128 f32 batch is 2 MiB of rows, and the protobuf classes copy a bytes
field on every step (into the message when parsing, out again on each attribute read, into the
message when building, out again when serializing). Here a request is one b"".join of a few
header bytes and the caller's token and gradient arrays (their buffers, not copies), and a
reply's rows are a memoryview into the bytes gRPC hands over, which numpy reads in place. The
field numbers and types are taken from the descriptors at import and checked, so a change to
the proto that this code does not follow fails at import instead of on the wire.
"""
import struct

from . import _stubs

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
# descriptor field types (google.protobuf.descriptor.FieldDescriptor.TYPE_*)
_T_DOUBLE, _T_UINT64, _T_FIXED64, _T_BOOL, _T_STRING = 1, 4, 6, 8, 9
_T_MESSAGE, _T_BYTES, _T_UINT32, _T_ENUM = 11, 12, 13, 14


_FIXED64_LE = struct.Struct("<Q")


class WireError(Exception):
    """A reply that does not parse."""


def varint(v):
    """v (a non-negative int) as a protobuf varint."""
    if v < 0x80:
        return bytes((v,))
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _key(number, wire_type):
    return varint(number << 3 | wire_type)


def _fields(full_name, expect):
    """{name: number} of full_name's fields named in expect ({name: descriptor type}), checked."""
    have = _stubs.messages().fields(full_name)
    out = {}
    for name, t in expect.items():
        if name not in have or have[name][1] != t:
            raise ImportError("embps: %s.%s is %s in proto/, this package expects type %d: update "
                              "embps/_wire.py" % (full_name, name, have.get(name), t))
        out[name] = have[name][0]
    return out


_BATCH_FIELDS = {"table": _T_STRING, "batch_id": _T_UINT64, "shard_index": _T_UINT32,
                 "shard_count": _T_UINT32, "tokens_per_batch": _T_UINT32, "tokens": _T_BYTES,
                 "dtype": _T_ENUM, "client_id": _T_UINT64, "digest": _T_FIXED64,
                 "attempt": _T_UINT32}
_LQ = _fields("embps.v1.LookupRequest", _BATCH_FIELDS)
_PQ = _fields("embps.v1.PushGradientsRequest",
              dict(_BATCH_FIELDS, gradients=_T_BYTES, mode=_T_ENUM))
_AQ = _fields("embps.v1.AssignRequest",
              dict(_BATCH_FIELDS, rows=_T_BYTES, reset_state=_T_BOOL))
_LR = _fields("embps.v1.LookupResponse", {"batch_id": _T_UINT64, "shard_index": _T_UINT32,
                                          "emb_width": _T_UINT32, "dtype": _T_ENUM,
                                          "rows": _T_BYTES})


class _Keys:
    def __init__(self, numbers):
        self.table = _key(numbers["table"], _LEN)
        self.batch_id = _key(numbers["batch_id"], _VARINT)
        self.shard_index = _key(numbers["shard_index"], _VARINT)
        self.shard_count = _key(numbers["shard_count"], _VARINT)
        self.tokens_per_batch = _key(numbers["tokens_per_batch"], _VARINT)
        self.tokens = _key(numbers["tokens"], _LEN)
        self.dtype = _key(numbers["dtype"], _VARINT)
        self.client_id = _key(numbers["client_id"], _VARINT)
        self.digest = _key(numbers["digest"], _FIXED64)
        self.attempt = _key(numbers["attempt"], _VARINT)
        if "gradients" in numbers:
            self.gradients = _key(numbers["gradients"], _LEN)
            self.mode = _key(numbers["mode"], _VARINT)
        if "rows" in numbers:
            self.rows = _key(numbers["rows"], _LEN)
            self.reset_state = _key(numbers["reset_state"], _VARINT)


_LOOKUP_KEYS = _Keys(_LQ)
_PUSH_KEYS = _Keys(_PQ)
_ASSIGN_KEYS = _Keys(_AQ)

# ---- feature batches (LookupFeatures, PushFeatures) ----

_FEATURE_BATCH_FIELDS = {"batch_id": _T_UINT64, "shard_index": _T_UINT32,
                         "shard_count": _T_UINT32, "batch_size": _T_UINT32,
                         "features": _T_MESSAGE, "client_id": _T_UINT64, "digest": _T_FIXED64,
                         "attempt": _T_UINT32}
_LFQ = _fields("embps.v1.LookupFeaturesRequest", _FEATURE_BATCH_FIELDS)
_PFQ = _fields("embps.v1.PushFeaturesRequest", dict(_FEATURE_BATCH_FIELDS, mode=_T_ENUM))
_FS = _fields("embps.v1.FeatureShard", {"name": _T_STRING, "table": _T_STRING,
                                         "pooling": _T_ENUM, "ids": _T_BYTES,
                                         "lengths": _T_BYTES, "weights": _T_BYTES,
                                         "gradients": _T_BYTES})
_LFR = _fields("embps.v1.LookupFeaturesResponse", {"batch_id": _T_UINT64,
                                                   "shard_index": _T_UINT32,
                                                   "features": _T_MESSAGE})
_FR = _fields("embps.v1.FeatureRows", {"name": _T_STRING, "emb_width": _T_UINT32,
                                        "dtype": _T_ENUM, "rows": _T_BYTES})
if any(_LFQ[f] != _PFQ[f] for f in _LFQ):
    raise ImportError("embps: LookupFeaturesRequest and PushFeaturesRequest number their common "
                      "fields differently in proto/: update embps/_wire.py")

_ATTEMPT_KEYS = {"lookup": _key(_LQ["attempt"], _VARINT), "push": _key(_PQ["attempt"], _VARINT),
                 "lookup_features": _key(_LFQ["attempt"], _VARINT),
                 "push_features": _key(_PFQ["attempt"], _VARINT),
                 "assign": _key(_AQ["attempt"], _VARINT)}


def _len_field(number, nbytes):
    """The key and length of a length-delimited field of nbytes bytes (the bytes follow)."""
    return _key(number, _LEN) + varint(nbytes)


def feature_shard(name_bytes, table_bytes, pooling, ids, lengths, weights=None, grads=None,
                  grad_pad_bytes=0):
    """One FeatureShard, encoded with its own key and length as field `features` of a
    LookupFeaturesRequest or PushFeaturesRequest: a list of parts (bytes and the callers'
    buffers, not copied) to join. ids: the shard's ids (int64 LE buffer); lengths: its samples'
    bag lengths (u32 LE buffer); weights: None or f32 LE, one per id; grads: None (a lookup) or
    the gradient rows' buffer, followed by grad_pad_bytes zero bytes (padding samples' rows)."""
    ib, lb = memoryview(ids).nbytes, memoryview(lengths).nbytes
    parts = [_len_field(_FS["name"], len(name_bytes)), name_bytes,
             _len_field(_FS["table"], len(table_bytes)), table_bytes]
    if pooling:
        parts.append(_key(_FS["pooling"], _VARINT) + varint(pooling))
    parts += [_len_field(_FS["ids"], ib), ids, _len_field(_FS["lengths"], lb), lengths]
    if weights is not None:
        parts += [_len_field(_FS["weights"], memoryview(weights).nbytes), weights]
    if grads is not None:
        gb = memoryview(grads).nbytes + grad_pad_bytes
        parts += [_len_field(_FS["gradients"], gb), grads]
        if grad_pad_bytes:
            parts.append(bytes(grad_pad_bytes))
    size = sum(memoryview(p).nbytes for p in parts)
    return [_len_field(_LFQ["features"], size)] + parts


def features_request(batch_id, shard_index, shard_count, batch_size, shards, client_id=0,
                     digest=0, mode=None):
    """A LookupFeaturesRequest's bytes (mode None) or a PushFeaturesRequest's (mode: the
    UpdateMode number). shards: every feature's parts from feature_shard, in the request's
    order. The attempt is 0 (not sent); see with_attempt for retries."""
    k = _LFQ
    parts = [_key(k["batch_id"], _VARINT), varint(batch_id),
             _key(k["shard_index"], _VARINT), varint(shard_index),
             _key(k["shard_count"], _VARINT), varint(shard_count),
             _key(k["batch_size"], _VARINT), varint(batch_size)]
    for s in shards:
        parts += s
    if client_id:
        parts.append(_key(k["client_id"], _VARINT) + varint(client_id))
    if digest:
        parts.append(_key(k["digest"], _FIXED64) + _FIXED64_LE.pack(digest))
    if mode:
        parts.append(_key(_PFQ["mode"], _VARINT) + varint(mode))
    return b"".join(parts)


def table_field(name):
    """The encoded table name (field 1 with its length), the same for both request kinds."""
    b = name.encode()
    assert _LQ["table"] == _PQ["table"]
    return _LOOKUP_KEYS.table + varint(len(b)) + b


def _head(k, table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, token_bytes):
    return b"".join((table_bytes, k.batch_id, varint(batch_id), k.shard_index, varint(shard_index),
                     k.shard_count, varint(shard_count), k.tokens_per_batch,
                     varint(tokens_per_batch), k.tokens, varint(token_bytes)))


def lookup_request(table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, tokens,
                   pad_bytes, dtype, client_id=0, digest=0):
    """A LookupRequest's bytes. tokens: a buffer of little-endian int64 (a numpy slice);
    pad_bytes: zero bytes appended to it (padding tokens); dtype: 0 or the expected dtype;
    client_id: 0 or the client's id (the scope of its batch ids); digest: 0 or the batch's
    digest (_digest.py). The attempt is 0 (not sent); see with_attempt for retries."""
    k = _LOOKUP_KEYS
    n = memoryview(tokens).nbytes + pad_bytes
    parts = [_head(k, table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, n),
             tokens]
    if pad_bytes:
        parts.append(bytes(pad_bytes))
    if dtype:
        parts.append(k.dtype + varint(dtype))
    if client_id:
        parts.append(k.client_id + varint(client_id))
    if digest:
        parts.append(k.digest + _FIXED64_LE.pack(digest))
    return b"".join(parts)


def push_request(table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, tokens,
                 pad_tokens, grads, row_bytes, dtype, mode, client_id=0, digest=0):
    """A PushGradientsRequest's bytes. tokens, grads: buffers of the shard's real tokens and
    gradient rows; pad_tokens: padding tokens (zero) and zero gradient rows of row_bytes to
    append; client_id and digest as for lookup_request."""
    k = _PUSH_KEYS
    tb = memoryview(tokens).nbytes + pad_tokens * 8
    gb = memoryview(grads).nbytes + pad_tokens * row_bytes
    parts = [_head(k, table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, tb),
             tokens]
    if pad_tokens:
        parts.append(bytes(pad_tokens * 8))
    parts.append(k.dtype + varint(dtype) + k.gradients + varint(gb))
    parts.append(grads)
    if pad_tokens:
        parts.append(bytes(pad_tokens * row_bytes))
    if mode:
        parts.append(k.mode + varint(mode))
    if client_id:
        parts.append(k.client_id + varint(client_id))
    if digest:
        parts.append(k.digest + _FIXED64_LE.pack(digest))
    return b"".join(parts)


def assign_request(table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, tokens,
                   pad_tokens, rows, row_bytes, dtype, reset_state, client_id=0, digest=0):
    """An AssignRequest's bytes: push_request's layout with the rows to write in place of
    gradients and reset_state (bool) in place of mode. Padding tokens (0) carry zero rows, which
    the servers skip."""
    k = _ASSIGN_KEYS
    tb = memoryview(tokens).nbytes + pad_tokens * 8
    rb = memoryview(rows).nbytes + pad_tokens * row_bytes
    parts = [_head(k, table_bytes, batch_id, shard_index, shard_count, tokens_per_batch, tb),
             tokens]
    if pad_tokens:
        parts.append(bytes(pad_tokens * 8))
    parts.append(k.dtype + varint(dtype) + k.rows + varint(rb))
    parts.append(rows)
    if pad_tokens:
        parts.append(bytes(pad_tokens * row_bytes))
    if reset_state:
        parts.append(k.reset_state + varint(1))
    if client_id:
        parts.append(k.client_id + varint(client_id))
    if digest:
        parts.append(k.digest + _FIXED64_LE.pack(digest))
    return b"".join(parts)


def with_attempt(request, kind, attempt):
    """request (a LookupRequest's, PushGradientsRequest's, LookupFeaturesRequest's or
    PushFeaturesRequest's bytes from the functions here, which never send an attempt) as
    attempt number `attempt` of the same batch: the field is appended (protobuf reads fields in
    any order), so everything else, the batch id and the digest included, stays byte for byte
    the first attempt's. kind: "lookup", "push", "lookup_features", "push_features" or
    "assign"."""
    if not attempt:
        return request
    key = _ATTEMPT_KEYS[kind]
    return b"".join((request, key, varint(attempt)))


def _read_varint(buf, i, end):
    shift = 0
    v = 0
    while True:
        if i >= end or shift > 63:
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, i
        shift += 7


_LR_BATCH, _LR_SHARD, _LR_WIDTH = _LR["batch_id"], _LR["shard_index"], _LR["emb_width"]
_LR_DTYPE, _LR_ROWS = _LR["dtype"], _LR["rows"]


def parse_lookup_response(buf):
    """(batch_id, shard_index, emb_width, dtype, rows) of a LookupResponse's bytes; rows is a
    memoryview into buf. Unknown fields are skipped. Raises WireError."""
    mv = memoryview(buf)
    end = len(mv)
    i = 0
    batch_id = shard_index = emb_width = dtype = 0
    rows = mv[0:0]
    while i < end:
        key, i = _read_varint(buf, i, end)
        number, wt = key >> 3, key & 7
        if wt == _VARINT:
            v, i = _read_varint(buf, i, end)
            if number == _LR_BATCH:
                batch_id = v
            elif number == _LR_SHARD:
                shard_index = v
            elif number == _LR_WIDTH:
                emb_width = v
            elif number == _LR_DTYPE:
                dtype = v
        elif wt == _LEN:
            n, i = _read_varint(buf, i, end)
            if i + n > end:
                raise WireError("a field of %d bytes runs past the end of the message" % n)
            if number == _LR_ROWS:
                rows = mv[i:i + n]
            i += n
        elif wt == _FIXED64:
            i += 8
        elif wt == _FIXED32:
            i += 4
        else:
            raise WireError("wire type %d" % wt)
        if i > end:
            raise WireError("a field runs past the end of the message")
    return batch_id, shard_index, emb_width, dtype, rows



def _walk(buf, start, end):
    """(number, value) of every field of the message in buf[start:end]: varints as ints,
    length-delimited fields as (start, end) of their bytes; fixed fields are skipped. Raises
    WireError."""
    i = start
    while i < end:
        key, i = _read_varint(buf, i, end)
        number, wt = key >> 3, key & 7
        if wt == _VARINT:
            v, i = _read_varint(buf, i, end)
            yield number, v
        elif wt == _LEN:
            n, i = _read_varint(buf, i, end)
            if i + n > end:
                raise WireError("a field of %d bytes runs past the end of the message" % n)
            yield number, (i, i + n)
            i += n
        elif wt == _FIXED64:
            i += 8
        elif wt == _FIXED32:
            i += 4
        else:
            raise WireError("wire type %d" % wt)
        if i > end:
            raise WireError("a field runs past the end of the message")


def parse_lookup_features_response(buf):
    """(batch_id, shard_index, [(name, emb_width, dtype, rows)]) of a LookupFeaturesResponse's
    bytes, features in the reply's order; rows are memoryviews into buf. Unknown fields are
    skipped. Raises WireError."""
    mv = memoryview(buf)
    batch_id = shard_index = 0
    features = []
    for number, v in _walk(mv, 0, len(mv)):
        if number == _LFR["batch_id"] and isinstance(v, int):
            batch_id = v
        elif number == _LFR["shard_index"] and isinstance(v, int):
            shard_index = v
        elif number == _LFR["features"] and isinstance(v, tuple):
            name, width, dtype, rows = "", 0, 0, mv[0:0]
            for n2, v2 in _walk(mv, v[0], v[1]):
                if n2 == _FR["name"] and isinstance(v2, tuple):
                    try:
                        name = bytes(mv[v2[0]:v2[1]]).decode()
                    except UnicodeDecodeError:
                        raise WireError("a feature's name is not UTF-8") from None
                elif n2 == _FR["emb_width"] and isinstance(v2, int):
                    width = v2
                elif n2 == _FR["dtype"] and isinstance(v2, int):
                    dtype = v2
                elif n2 == _FR["rows"] and isinstance(v2, tuple):
                    rows = mv[v2[0]:v2[1]]
            features.append((name, width, dtype, rows))
    return batch_id, shard_index, features
