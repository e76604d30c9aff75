"""The batch digest (docs/design.md, "A batch's identity"), bit for bit the C library's.

XXH3-64 with seed 0 over, in order:
  - the 14 ASCII bytes b"embps-batch-v1";
  - the table name's UTF-8 length as a little-endian u32, then its bytes;
  - tokens_per_batch (T: the whole batch's tokens after padding) as a little-endian u32;
  - all T tokens of the whole batch in order (shard 0's, then shard 1's, ...) as little-endian
    int64, padding tokens (0) included.
A result of 0 becomes 1: 0 on the wire means "no digest".

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
_U32 = struct.Struct("<I")
_ZEROS = bytes(8 * 64)


def available():
    """True when the xxhash module is there (else digest() raises ImportError)."""
    return _xxhash is not None


def digest(table, tokens, tokens_per_batch):
    """The digest of a batch of table (a str, or its UTF-8 bytes), whose real tokens are tokens
    (a C-contiguous little-endian int64 buffer, e.g. a numpy array) followed by padding tokens 0
    up to tokens_per_batch. Returns an int in [1, 2**64). Raises ImportError without xxhash,
    ValueError when tokens holds more than tokens_per_batch tokens."""
    if _xxhash is None:
        raise ImportError("embps: the batch digest needs the xxhash module (%s): install "
                          "python3-xxhash (Debian) or xxhash (pip)" % _IMPORT_ERROR)
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
