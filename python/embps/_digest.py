"""The batch digest (docs/design.md, "A batch's identity"), bit for bit the C library's.

XXH3-64 with seed 0 over, in order:
  - the 14 ASCII bytes b"embps-batch-v1";
  - the table name's UTF-8 length as a little-endian u32, then its bytes;
  - tokens_per_batch (T: the whole batch's tokens after padding) as a little-endian u32;
  - all T tokens of the whole batch in order (shard 0's, then shard 1's, ...) as little-endian
    int64, padding tokens (0) included.
A result of 0 becomes 1: 0 on the wire means "no digest".

A feature batch (LookupFeatures, PushFeatures; docs/design.md, "Feature batches") has its own:
XXH3-64 with seed 0 over the 17 ASCII bytes b"embps-features-v1", batch_size B (after padding)
as a u32 LE, the number of features as a u32 LE, then for each feature in the request's order:
its name and its table (each a u32 LE byte length and the UTF-8 bytes), its pooling (the
Pooling number) as a u32 LE, its id count over the whole batch as a u64 LE, all its ids (int64
LE, shard 0's then shard 1's: the caller's order, since padding samples hold none), its B bag
lengths (u32 LE, padding samples' 0 included) and, for weighted sum only, its weights (f32 LE).
0 becomes 1 here too (features_digest).

Every shard of a batch carries it; the leader joins only shards whose digests are equal, and a
retried push is recognised by (client_id, batch_id, digest). Hashing is streamed (no copy of the
tokens): about 8 bytes a token, cheap beside the rows. XXH3 comes from the xxhash module
(Debian's python3-xxhash, pip's xxhash); the C library compiles libxxhash's XXH3 in from its
header (common/digest.c).
"""
import struct

try:
    import xxhash as _xxhash
except ImportError as _e:  # refused when a batch is made, with the remedy (see digest())
    _xxhash = None
    _IMPORT_ERROR = str(_e)

MAGIC = b"embps-batch-v1"
FEATURES_MAGIC = b"embps-features-v1"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ZEROS = bytes(8 * 64)


def available():
    """True when the xxhash module is there (else digest() raises ImportError)."""
    return _xxhash is not None


def _missing():
    return ImportError("embps: the batch digest needs the xxhash module (%s): install "
                       "python3-xxhash (Debian) or xxhash (pip)" % _IMPORT_ERROR)


def digest(table, tokens, tokens_per_batch):
    """The digest of a batch of table (a str, or its UTF-8 bytes), whose real tokens are tokens
    (a C-contiguous little-endian int64 buffer, e.g. a numpy array) followed by padding tokens 0
    up to tokens_per_batch. Returns an int in [1, 2**64). Raises ImportError without xxhash,
    ValueError when tokens holds more than tokens_per_batch tokens."""
    if _xxhash is None:
        raise _missing()
    name = table.encode() if isinstance(table, str) else bytes(table)
    mv = memoryview(tokens).cast("B")
    n = mv.nbytes // 8
    if mv.nbytes % 8 or n > tokens_per_batch:
        raise ValueError("digest: %d bytes of tokens for tokens_per_batch=%d"
                         % (mv.nbytes, tokens_per_batch))
    h = _xxhash.xxh3_64(seed=0)
    h.update(MAGIC)
    h.update(_U32.pack(len(name)))
    h.update(name)
    h.update(_U32.pack(tokens_per_batch))
    if n:
        h.update(mv)
    pad = (tokens_per_batch - n) * 8
    while pad:
        k = min(pad, len(_ZEROS))
        h.update(_ZEROS[:k])
        pad -= k
    return h.intdigest() or 1


def features_digest(batch_size, features):
    """The digest of a feature batch of batch_size samples (after padding). features: in the
    request's order, (name, table, pooling, ids, lengths, weights) each: name and table as str
    or UTF-8 bytes, pooling the Pooling number, ids a C-contiguous int64 LE buffer (every id of
    the batch), lengths a u32 LE buffer of batch_size bag lengths, weights None or an f32 LE
    buffer (hashed only when given: weighted sum). Returns an int in [1, 2**64). Raises
    ImportError without xxhash."""
    if _xxhash is None:
        raise _missing()
    h = _xxhash.xxh3_64(seed=0)
    h.update(FEATURES_MAGIC)
    h.update(_U32.pack(batch_size))
    h.update(_U32.pack(len(features)))
    for name, table, pooling, ids, lengths, weights in features:
        for s in (name, table):
            b = s.encode() if isinstance(s, str) else bytes(s)
            h.update(_U32.pack(len(b)))
            h.update(b)
        h.update(_U32.pack(pooling))
        mv = memoryview(ids).cast("B")
        h.update(_U64.pack(mv.nbytes // 8))
        for buf in (mv, memoryview(lengths).cast("B"),
                    None if weights is None else memoryview(weights).cast("B")):
            if buf is not None and buf.nbytes:
                h.update(buf)
    return h.intdigest() or 1
