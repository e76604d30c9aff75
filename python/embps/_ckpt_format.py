"""The checkpoint files as embps.checkpoint reads them (docs/checkpoint-format.md): manifests,
slice files (memory-mapped, each block verified when first read), hash-keyed tables' key indexes
(whole and deltas), and the copy of a file's blocks into a table's rows. Private: the public
face is embps/checkpoint.py."""
import builtins
import os
import re
import struct
import zlib

import grpc
import numpy as np

from .errors import Error

MANIFEST = "MANIFEST"
_NAME = re.compile(r"^ckpt-(\d{20})$")
_VERSIONS = (1, 2)
_MANIFEST_MAX = 256 << 20
_BLOCK_TARGET = 1 << 20
_BLOCK_HEADER = 20
_TRAILER = 32
_INDEX_RANK = 0xFFFFFFFF
_INDEX_DELTA_RANK = 0xFFFFFFFE
_DTYPES = {1: ("f32", np.dtype("<f4")), 2: ("bf16", np.dtype("<u2"))}
_OPTIMIZERS = {1: "sgd", 2: "adagrad", 3: "rowwise_adagrad", 4: "adam"}
# name: (the state arrays' names, whether the state is one float a row)
_STATE = {"sgd": ((), False), "adagrad": (("accumulators",), False),
          "rowwise_adagrad": (("accumulators",), True), "adam": (("m", "v"), False)}
_EVICTIONS = {0: None, 1: "lru", 2: "lfu", 3: "ttl"}
_F32 = np.dtype("<f4")


class CheckpointError(Error):
    """A checkpoint that cannot be read: code is grpc.StatusCode.DATA_LOSS (a missing, truncated
    or corrupt file, a broken chain), NOT_FOUND (no complete checkpoint there, or no such table)
    or FAILED_PRECONDITION (a format version this reader does not know). file: the file at fault
    (or None); block: the index of the block at fault in it (or None)."""

    def __init__(self, code, message, file=None, block=None):
        super().__init__(code, message)
        self.file = file
        self.block = block


def _loss(message, file=None, block=None):
    return CheckpointError(grpc.StatusCode.DATA_LOSS, message, file, block)


# ---- bytes ------------------------------------------------------------------------------------

class _Bytes:
    """Little-endian fields read in order from a buffer; a read past the end raises."""

    def __init__(self, buf, off, end, path):
        self.buf, self.off, self.end, self.path = buf, off, end, path

    def take(self, fmt):
        n = struct.calcsize(fmt)
        if self.off + n > self.end:
            raise _loss("checkpoint file %s is malformed: it ends inside its fields" % self.path,
                        self.path)
        v = struct.unpack_from(fmt, self.buf, self.off)
        self.off += n
        return v if len(v) > 1 else v[0]

    def name(self):
        n = self.take("<I")
        if n >= 128 or self.off + n > self.end:
            raise _loss("checkpoint file %s is malformed: a name of %d bytes" % (self.path, n),
                        self.path)
        s = bytes(self.buf[self.off:self.off + n]).decode("utf-8", "replace")
        self.off += n
        return s

    def spec(self, version):
        s = {"name": self.name()}
        (s["rows"], s["emb_width"], dtype, s["seed"], s["init_scale"], opt, s["lr"], s["eps"],
         s["half_life"], s["initial_accumulator"], s["weight_decay"], s["beta1"],
         s["beta2"]) = self.take("<QIIQfIfffffff")
        s["capacity"], s["admit_after"], eviction, s["half_life_steps"], s["ttl_steps"], \
            s["sketch_width"] = self.take("<QIIQQI") if version >= 2 else (0, 0, 0, 0, 0, 0)
        if dtype not in _DTYPES or opt not in _OPTIMIZERS or eviction not in _EVICTIONS:
            raise _loss("checkpoint file %s is malformed: table '%s' has dtype %d, optimizer %d, "
                        "eviction %d" % (self.path, s["name"], dtype, opt, eviction), self.path)
        s["dtype"], s["optimizer"], s["eviction"] = (_DTYPES[dtype][0], _OPTIMIZERS[opt],
                                                     _EVICTIONS[eviction])
        return s


def _check_version(path, version):
    if version not in _VERSIONS:
        raise CheckpointError(grpc.StatusCode.FAILED_PRECONDITION,
                              "%s has checkpoint format version %d; this reader reads versions "
                              "%d to %d" % (path, version, _VERSIONS[0], _VERSIONS[-1]), path)


def _read_whole(path, want=None):
    try:
        with builtins.open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if want is None and size > _MANIFEST_MAX:
                raise _loss("checkpoint manifest %s is corrupt: %d bytes" % (path, size), path)
            data = f.read()
    except FileNotFoundError:
        raise _loss("checkpoint file %s is missing" % path, path) from None
    if want is not None and len(data) != want:
        raise _loss("checkpoint file %s is %d bytes; its manifest says %d" % (path, len(data),
                                                                              want), path)
    return data


class _Manifest:
    def __init__(self, ckpt_dir):
        path = os.path.join(ckpt_dir, MANIFEST)
        if not os.path.isfile(path):
            raise CheckpointError(grpc.StatusCode.NOT_FOUND,
                                  "%s is not a complete checkpoint: it has no manifest (it was cut "
                                  "short, is being written, or is no checkpoint)" % ckpt_dir, path)
        b = _read_whole(path)
        if len(b) < 20 or b[:8] != b"EMBPSMAN":
            raise _loss("checkpoint manifest %s is truncated or not a manifest" % path, path)
        version, body = struct.unpack_from("<II", b, 8)
        _check_version(path, version)
        if body + 20 != len(b):
            raise _loss("checkpoint manifest %s is truncated or overlong (%d bytes; its header "
                        "says %d)" % (path, len(b), body + 20), path)
        want, got = struct.unpack_from("<I", b, len(b) - 4)[0], zlib.crc32(b[:-4])
        if want != got:
            raise _loss("checkpoint manifest %s is corrupt: crc32 expected %08x, actual %08x"
                        % (path, want, got), path)
        r = _Bytes(b, 16, len(b) - 4, path)
        self.path, self.dir, self.version = path, ckpt_dir, version
        self.round, self.base_round, self.time_ms, self.group_size = r.take("<QQQI")
        self.scope = r.name()
        self.bytes = r.take("<Q")
        self.tables = {}
        for _ in range(r.take("<I")):
            s = r.spec(version)
            self.tables[s["name"]] = s
        self.files = {}
        for _ in range(r.take("<I")):
            rank = r.take("<I")
            table = r.name()
            self.files[(rank, table)] = r.take("<Q")
        if r.off != r.end or not self.group_size:
            raise _loss("checkpoint manifest %s is malformed" % path, path)

    def index_file(self, table):
        for rank in (_INDEX_RANK, _INDEX_DELTA_RANK):
            if (rank, table) in self.files:
                return rank, self.files[(rank, table)]
        return None, None


def _ckpt_path(directory, round_):
    return os.path.join(directory, "ckpt-%020d" % round_)


# ---- slice files --------------------------------------------------------------------------------

def _row_bytes(spec, width):
    esz = _DTYPES[{"f32": 1, "bf16": 2}[spec["dtype"]]][1].itemsize
    names, per_row = _STATE[spec["optimizer"]]
    s0 = 4 if per_row and names else 4 * width if names else 0
    s1 = 4 * width if len(names) == 2 else 0
    return width * esz, s0, s1


class _Slice:
    """One rank's slice file of a table in one checkpoint, memory-mapped, its header and trailer
    verified at open, its blocks verified as they are first read."""

    def __init__(self, manifest, spec, rank, table_rows):
        name = "r%d-%s.embps" % (rank, spec["name"])
        path = os.path.join(manifest.dir, name)
        want = manifest.files.get((rank, spec["name"]))
        if want is None:
            raise _loss("the manifest of %s does not list %s" % (manifest.dir, name), path)
        self.path, self.rank, self.rows = path, rank, table_rows
        g = manifest.group_size
        self.width = spec["emb_width"] // g
        self.col = rank * self.width
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise _loss("checkpoint file %s is missing" % path, path) from None
        self.size = size
        self.buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self.hlen = self._header(manifest, spec)
        if size != want:
            where = self._where_cut() if size < want else ""
            raise _loss("checkpoint file %s has %d bytes, its manifest says %d: it is truncated%s "
                        "or was overwritten" % (path, size, want, where), path,
                        getattr(self, "cut_block", None))
        if not self.hlen:
            raise _loss("checkpoint file %s is truncated (in its header)" % path, path)
        self.rb = _row_bytes(spec, self.width)
        self.per_row = sum(self.rb)
        self._trailer()
        self.firsts = self.counts = self.offs = None  # the block index, built at first use
        self.verified = None
        self.crcs = None

    def _header(self, manifest, spec):
        b, path = self.buf, self.path
        if self.size < 16:
            return 0
        if bytes(b[:8]) != b"EMBPSCKP":
            raise _loss("%s is not an embps checkpoint file (bad magic)" % path, path)
        version, hlen = struct.unpack_from("<II", b, 8)
        _check_version(path, version)
        if hlen < 20 or hlen > 4096:
            raise _loss("checkpoint file %s is corrupt: header length %d" % (path, hlen), path)
        if hlen > self.size:
            return 0
        want, got = struct.unpack_from("<I", b, hlen - 4)[0], zlib.crc32(b[:hlen - 4])
        if want != got:
            raise _loss("checkpoint file %s is corrupt: its header fails its crc32 (expected %08x, "
                        "actual %08x)" % (path, want, got), path)
        r = _Bytes(b, 16, hlen - 4, path)
        (self.h_rank, self.h_group, self.h_col, self.h_width, self.h_round, self.step,
         self.h_base, self.blocks, self.rows_written) = r.take("<IIIIQQQQQ")
        h_spec = r.spec(version)
        if r.off != r.end:
            raise _loss("checkpoint file %s has a malformed header" % path, path)
        if (self.h_rank != self.rank or self.h_group != manifest.group_size
                or self.h_col != self.col or self.h_width != self.width
                or self.h_round != manifest.round
                or self.h_base not in (0, manifest.base_round)
                or h_spec != spec):
            raise _loss("checkpoint file %s does not match its manifest (rank, group size, "
                        "columns, round or table spec differ)" % path, path)
        return hlen

    def _where_cut(self):
        if not self.hlen:
            return " (it ends in its header)"
        off = self.hlen
        for b in range(self.blocks):
            if off + _BLOCK_HEADER > self.size:
                self.cut_block = b
                return " (it ends in block %d, in its header)" % b
            first, n, nbytes, _ = struct.unpack_from("<QIII", self.buf, off)
            if off + _BLOCK_HEADER + nbytes > self.size:
                self.cut_block = b
                return " (it ends in block %d, rows %d..%d)" % (b, first, first + max(n, 1) - 1)
            off += _BLOCK_HEADER + nbytes
        return " (it ends in its trailer)"

    def _trailer(self):
        b, path, off = self.buf, self.path, self.size - _TRAILER
        if off < self.hlen:
            raise _loss("checkpoint file %s is truncated (in its trailer)" % path, path)
        magic = bytes(b[off:off + 8])
        blocks, rows, self.t_blocks_crc, crc = struct.unpack_from("<QQII", b, off + 8)
        got = zlib.crc32(b[off:off + 28])
        if crc != got:
            raise _loss("checkpoint file %s is corrupt: its trailer fails its crc32 (expected "
                        "%08x, actual %08x)" % (path, crc, got), path)
        if magic != b"EMBPSEND" or blocks != self.blocks or rows != self.rows_written:
            raise _loss("checkpoint file %s is corrupt: its trailer does not match its header"
                        % path, path)

    def full_layout(self):
        per_block = max(1, _BLOCK_TARGET // self.per_row) if self.per_row < _BLOCK_TARGET else 1
        return (self.h_base == 0 and self.rows_written == self.rows
                and self.blocks == -(-self.rows // per_block)), per_block

    def index(self):
        """The blocks' first rows, row counts and offsets (built once: computed for a full slice,
        else by walking the block headers)."""
        if self.firsts is not None:
            return
        full, per_block = self.full_layout()
        nb = self.blocks
        if full:
            firsts = np.arange(nb, dtype=np.int64) * per_block
            counts = np.minimum(per_block, self.rows - firsts)
            offs = self.hlen + np.arange(nb, dtype=np.int64) * (_BLOCK_HEADER + per_block
                                                                * self.per_row)
        else:
            firsts = np.empty(nb, np.int64)
            counts = np.empty(nb, np.int64)
            offs = np.empty(nb, np.int64)
            off, next_row = self.hlen, 0
            for b in range(nb):
                first, n, nbytes, crc = struct.unpack_from("<QIII", self.buf, off)
                self._check_claim(b, first, n, nbytes, crc, off, next_row)
                firsts[b], counts[b], offs[b] = first, n, off
                next_row = first + n
                off += _BLOCK_HEADER + nbytes
            if off != self.size - _TRAILER:
                raise _loss("checkpoint file %s is corrupt: its blocks end at byte %d, its "
                            "trailer starts at %d" % (self.path, off, self.size - _TRAILER),
                            self.path)
        self.counts, self.offs, self.ends = counts, offs, firsts + counts
        self.verified = np.zeros(nb, dtype=bool)
        self.crcs = np.zeros(nb, dtype="<u4")
        self.firsts = firsts  # last: it says the index is built

    def _check_claim(self, b, first, n, nbytes, crc, off, next_row):
        if (not n or first < next_row or first + n > self.rows or nbytes != n * self.per_row
                or off + _BLOCK_HEADER + nbytes > self.size - _TRAILER):
            raise _loss("checkpoint file %s is corrupt: block %d claims rows %d+%d in %d bytes "
                        "(crc32 %08x), which the table cannot hold"
                        % (self.path, b, first, n, nbytes, crc), self.path, b)

    def verify_block(self, b):
        if self.verified[b]:
            return
        off, first, n = int(self.offs[b]), int(self.firsts[b]), int(self.counts[b])
        h_first, h_n, nbytes, want = struct.unpack_from("<QIII", self.buf, off)
        if h_first != first or h_n != n or nbytes != n * self.per_row:
            self._check_claim(b, h_first, h_n, nbytes, want, off, 0)
            raise _loss("checkpoint file %s is corrupt: block %d holds rows %d+%d where a full "
                        "slice's block holds %d+%d" % (self.path, b, h_first, h_n, first, n),
                        self.path, b)
        got = zlib.crc32(self.buf[off + _BLOCK_HEADER:off + _BLOCK_HEADER + nbytes],
                         zlib.crc32(self.buf[off:off + 16]))
        if got != want:
            raise _loss("checkpoint file %s is corrupt: block %d (rows %d..%d) fails its crc32 "
                        "(expected %08x, actual %08x)" % (self.path, b, first, first + n - 1,
                                                          want, got), self.path, b)
        self.crcs[b] = want
        self.verified[b] = True
        if self.verified.all():
            got = zlib.crc32(self.crcs.tobytes())
            if got != self.t_blocks_crc:
                raise _loss("checkpoint file %s is corrupt: its trailer does not match its blocks "
                            "(crc32 of the blocks' crc32s: expected %08x, actual %08x)"
                            % (self.path, self.t_blocks_crc, got), self.path)

    def array(self, b, a):
        """Array a (0 rows, 1 state0, 2 state1) of block b, as it lies in the file."""
        off, n = int(self.offs[b]) + _BLOCK_HEADER, int(self.counts[b])
        off += n * sum(self.rb[:a])
        seg = self.buf[off:off + n * self.rb[a]]
        if a == 1 and self.per_row_state:
            return seg.view(_F32)  # one float a row
        return seg.view(self.dtype if a == 0 else _F32).reshape(n, self.width)


# ---- key indexes -------------------------------------------------------------------------------

_IX_STATE = "<9Q"  # clock, base, admitted, evicted, expired, refused, not_admitted, size, free


def _index_envelope(path, b, magic):
    if len(b) < 60 or b[:8] != magic:
        raise _loss("hash index %s is truncated or not a %s file" % (path, magic.decode()), path)
    version = struct.unpack_from("<I", b, 8)[0]
    if version != 1:
        raise CheckpointError(grpc.StatusCode.FAILED_PRECONDITION,
                              "hash index %s has format version %d; this reader reads 1"
                              % (path, version), path)
    want, got = struct.unpack_from("<I", b, len(b) - 4)[0], zlib.crc32(b[:-4])
    if want != got:
        raise _loss("hash index %s is corrupt: crc32 expected %08x, actual %08x"
                    % (path, want, got), path)


def _index_config(path, b, spec):
    policy, capacity = struct.unpack_from("<IQ", b, 12)
    if capacity != spec["capacity"] or _EVICTIONS.get(policy) != spec["eviction"]:
        raise CheckpointError(grpc.StatusCode.FAILED_PRECONDITION,
                              "hash index %s was written for another table (capacity %d, policy "
                              "%d)" % (path, capacity, policy), path)


def _index_whole(path, b, spec):
    """The key of every slot (0: free) and the index's state, from a whole index."""
    _index_envelope(path, b, b"EMBPSHIX")
    _index_config(path, b, spec)
    state = struct.unpack_from(_IX_STATE, b, 56)
    size, nfree = state[7], state[8]
    cap = spec["capacity"]
    end = 128 + 4 * nfree + 20 * size
    if size + nfree != cap or end > len(b) - 4:
        raise _loss("hash index %s is malformed: %d keys and %d free slots of %d"
                    % (path, size, nfree, cap), path)
    free = np.frombuffer(b, "<u4", nfree, 128).astype(np.int64)
    entries = np.frombuffer(b, np.dtype([("slot", "<u4"), ("key", "<u8"), ("score", "<u8")]),
                            size, 128 + 4 * nfree)
    keys = np.zeros(cap, np.uint64)
    slots = entries["slot"].astype(np.int64)
    if size and (slots.max() >= cap or np.any(np.diff(slots) <= 0)
                 or np.any(entries["key"] == 0)):
        raise _loss("hash index %s is malformed: its slots are not ascending or a key is 0"
                    % path, path)
    keys[slots] = entries["key"]
    return keys, free, state


def _index_delta(path, b, spec, keys, free, state):
    """Applies a delta onto (keys, free stack, state) of the index before it."""
    _index_envelope(path, b, b"EMBPSHXD")
    _index_config(path, b, spec)
    frm = struct.unpack_from(_IX_STATE, b, 56)
    to = struct.unpack_from(_IX_STATE, b, 128)
    kept, nslots, _ = struct.unpack_from("<3Q", b, 200)
    if frm != tuple(state):
        raise _loss("hash index %s does not apply on the index before it (the chain is broken)"
                    % path, path)
    cap = spec["capacity"]
    if kept > len(free) or kept > to[8] or 224 + 4 * (to[8] - kept) + 20 * nslots > len(b) - 4:
        raise _loss("hash index %s is malformed" % path, path)
    new_free = np.frombuffer(b, "<u4", to[8] - kept, 224).astype(np.int64)
    entries = np.frombuffer(b, np.dtype([("slot", "<u4"), ("key", "<u8"), ("score", "<u8")]),
                            nslots, 224 + 4 * (to[8] - kept))
    slots = entries["slot"].astype(np.int64)
    if (nslots and slots.max() >= cap) or (len(new_free) and new_free.max() >= cap):
        raise _loss("hash index %s is malformed: a slot beyond the capacity" % path, path)
    keys = keys.copy()
    keys[new_free] = 0
    keys[slots] = entries["key"]
    free = np.concatenate([free[:kept], new_free])
    if int(np.count_nonzero(keys)) != to[7] or len(free) != to[8]:
        raise _loss("hash index %s is malformed: its keys do not add up to its size" % path, path)
    return keys, free, to


def _fill(sl, a, r0, r1, phys, per_row, out):
    """Copies slice file sl's part of array a's rows [r0, r1) (or rows phys) into out, verifying
    each block it reads first."""
    sl.index()
    lo, hi = (r0, r1) if phys is None else (int(phys[0]), int(phys[-1]) + 1)
    if phys is None:
        blocks = range(int(np.searchsorted(sl.ends, lo, "right")),
                       int(np.searchsorted(sl.firsts, hi, "left")))
    else:
        bi = np.searchsorted(sl.firsts, phys, "right") - 1
        inside = (bi >= 0) & (phys < sl.ends[np.maximum(bi, 0)])
        blocks = np.unique(bi[inside])
    cols = slice(None) if per_row else slice(sl.col, sl.col + sl.width)
    for b in blocks:
        b = int(b)
        sl.verify_block(b)
        first, cnt = int(sl.firsts[b]), int(sl.counts[b])
        src = sl.array(b, a)
        if phys is None:
            s0, s1 = max(first, r0), min(first + cnt, r1)
            if per_row:
                out[s0 - r0:s1 - r0] = src[s0 - first:s1 - first]
            else:
                out[s0 - r0:s1 - r0, cols] = src[s0 - first:s1 - first]
        else:
            j0 = int(np.searchsorted(phys, first, "left"))
            j1 = int(np.searchsorted(phys, first + cnt, "left"))
            pick = phys[j0:j1] - first
            if per_row:
                out[j0:j1] = src[pick]
            else:
                out[j0:j1, cols] = src[pick]


def _read_index(chain, spec):
    """A hash-keyed table's key of every slot at the top of chain: the newest whole index at or
    below it, then every delta after it."""
    name = spec["name"]
    start = None
    for i in range(len(chain) - 1, -1, -1):
        rank, _ = chain[i].index_file(name)
        if rank is None and name in chain[i].tables:
            raise _loss("the manifest of %s lists no key index (INDEX-%s) of hash-keyed table "
                        "'%s'" % (chain[i].dir, name, name), chain[i].path)
        if rank == _INDEX_RANK:
            start = i
            break
    if start is None:
        raise _loss("the checkpoint chain of table '%s' holds no whole key index" % name)
    keys = free = state = None
    for m in chain[start:]:
        rank, size = m.index_file(name)
        path = os.path.join(m.dir, "INDEX-" + name)
        b = _read_whole(path, size)
        if rank == _INDEX_RANK:
            keys, free, state = _index_whole(path, b, spec)
        else:
            keys, free, state = _index_delta(path, b, spec, keys, free, state)
    return keys
