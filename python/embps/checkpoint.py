"""embps.checkpoint: the tables of an embps checkpoint as numpy arrays, offline (no server).

    import embps.checkpoint
    with embps.checkpoint.open("/data/ckpt") as ck:       # the newest complete checkpoint
        t = ck["items"]
        t.rows.shape                  # (rows, emb_width); a hash-keyed table: (keys stored, W)
        first = t.rows[:1000]         # reads (and verifies) only the blocks that hold them
        some = t.rows[[5, 17, 3]]     # any rows, in the order asked
        whole = np.asarray(t.rows)    # the whole table, assembled
        t.keys                        # a hash-keyed table's keys (int64), row i is key i's
        t.state["accumulators"]       # the optimizer's arrays, as views like t.rows

Pure Python over numpy and the standard library's zlib: the format's checksum is zlib's crc32
(docs/checkpoint-format.md). A checkpoint written by any group size, full or incremental (through
its chain), reads the same. The slice files are memory-mapped (numpy.memmap): `t.rows` is a
`Rows` view that reads the blocks a row selection touches when it is indexed, so a notebook
reads a table larger than memory a slice at a time. No layout of the format puts a table's rows
in one contiguous run (every block of at most 1 MiB opens with a 20-byte header, and an
optimizer's state follows the rows block by block), so no checkpoint can be one zero-copy
(rows, W) array: `np.asarray(t.rows)` and `t.rows[a:b]` copy what they return.

Verification: every manifest, slice header, trailer and key index is verified at open(); each
block's crc32 the first time any of its rows is read, before a row of it is returned; a file's
trailer's checksum of its blocks' checksums once all its blocks are verified. open(...,
verify=True), or verify() later, reads and verifies every block at once. A corrupt or truncated
file raises CheckpointError naming the file and, for a block, the block.
"""
import os

import grpc
import numpy as np

from ._ckpt_format import (_DTYPES, _F32, _NAME, _STATE, MANIFEST, CheckpointError, _ckpt_path,
                           _fill, _loss, _Manifest, _read_index, _Slice)

__all__ = ["open", "Checkpoint", "Table", "Rows", "CheckpointError", "bf16_to_float32"]

def bf16_to_float32(a):
    """A bf16 table's rows (their uint16 bit patterns, as Rows give them) as float32: exact, since
    bf16 is the high half of a float32."""
    return (np.asarray(a, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


# ---- tables ------------------------------------------------------------------------------------

class Rows:
    """A read-only array of a table's rows (or of one optimizer state array) that reads the
    checkpoint's blocks when indexed. shape, dtype, ndim, len() as a numpy array's; indexing with
    an int, a slice, a sequence or array of ints, or a boolean mask (and a second index for the
    columns) returns a new numpy array; np.asarray(rows) assembles the whole; chunks() iterates
    over it in pieces. A bf16 table's rows are uint16 bit patterns (bf16_to_float32 widens them).
    """

    def __init__(self, table, a, ncols, dtype):
        self._t, self._a = table, a
        self.dtype = np.dtype(dtype)
        self.shape = (table.num_rows, ncols) if ncols else (table.num_rows,)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return "Rows(table=%r, shape=%s, dtype=%s)" % (self._t.name, self.shape, self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = self._range(0, self.shape[0])
        return out if dtype is None else out.astype(dtype, copy=False)

    def __iter__(self):
        for _, chunk in self.chunks():
            yield from chunk

    def chunks(self, rows=None):
        """Yields (first row, array) over the whole, rows at a time (default: about 4 MiB, which
        a cache holds while the ranks' columns are put together: the fastest pass)."""
        per = self.dtype.itemsize * (self.shape[1] if self.ndim == 2 else 1)
        rows = rows or max(1, _PIECE_BYTES // per)
        for r in range(0, self.shape[0], rows):
            yield r, self._range(r, min(r + rows, self.shape[0]))

    def __getitem__(self, key):
        cols = None
        if isinstance(key, tuple):
            if len(key) > self.ndim:
                raise IndexError("too many indices for a %d-dimensional array" % self.ndim)
            key, cols = key[0], (key[1] if len(key) > 1 else None)
        n = self.shape[0]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError("row %d is out of bounds for %d rows" % (int(key), n))
            out = self._range(i, i + 1)[0]
        elif isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                out = self._range(start, max(start, stop))
            else:
                out = self._take(np.arange(start, stop, step, dtype=np.int64))
        elif key is Ellipsis:
            out = self._range(0, n)
        else:
            idx = np.asarray(key)
            if idx.dtype == bool:
                if idx.shape != (n,):
                    raise IndexError("a boolean index of shape %s for %d rows" % (idx.shape, n))
                idx = np.flatnonzero(idx)
            if idx.dtype.kind not in "iu":
                raise IndexError("rows are indexed by integers, slices or a boolean mask")
            shape = idx.shape
            idx = idx.astype(np.int64).reshape(-1)
            idx = np.where(idx < 0, idx + n, idx)
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise IndexError("a row index is out of bounds for %d rows" % n)
            out = self._take(idx).reshape(shape + self.shape[1:])
        return out if cols is None else out[..., cols]

    def _range(self, r0, r1):
        t = self._t
        if t.slots is None:
            return t._read(self._a, r0, r1, None)
        return t._read(self._a, 0, 0, t.slots[r0:r1])

    def _take(self, idx):
        if not idx.size:
            return np.empty((0,) + self.shape[1:], self.dtype)
        uniq, inv = np.unique(idx, return_inverse=True)
        phys = uniq if self._t.slots is None else self._t.slots[uniq]
        return self._t._read(self._a, 0, 0, phys)[inv]


class Table:
    """One table of a checkpoint.

    name, spec (its settings as the manifest lists them: a dict), kind ("dense" or "hash"),
    dtype ("f32" or "bf16"), emb_width, optimizer, step (optimizer steps applied), num_rows (a
    dense table's rows; a hash-keyed table's keys stored); rows (a Rows view, num_rows x
    emb_width); keys (a hash-keyed table's stored keys as int64, in ascending slot order: row i
    is key i's; None when dense); slots (the slot of each key; None when dense); state (the
    optimizer's arrays by name, Rows views: "accumulators" for adagrad (num_rows x emb_width)
    and rowwise_adagrad (num_rows), "m" and "v" for adam; empty for sgd)."""

    def __init__(self, ckpt, chain, name):
        top = chain[-1]
        self.spec = dict(top.tables[name])
        self.name = name
        self.kind = "hash" if self.spec["capacity"] else "dense"
        self.dtype = self.spec["dtype"]
        self.emb_width = self.spec["emb_width"]
        self.optimizer = self.spec["optimizer"]
        self.capacity = self.spec["capacity"]
        self._phys_rows = self.capacity or self.spec["rows"]
        self._layers = []  # oldest first: the slices of each checkpoint that holds the table
        started = False
        for m in chain:
            s = m.tables.get(name)
            if s is None:
                continue
            for k in ("rows", "capacity", "emb_width", "dtype", "optimizer"):
                if s[k] != self.spec[k]:
                    raise _loss("the checkpoint chain is broken: table '%s' differs between "
                                "rounds %d and %d" % (name, m.round, top.round))
            g = m.group_size
            if not self.emb_width // g or self.emb_width % g:
                raise _loss("checkpoint of round %d: table '%s' of width %d cannot have been "
                            "written by %d ranks" % (m.round, name, self.emb_width, g))
            layer = [_Slice(m, s, r, self._phys_rows) for r in range(g)]
            for sl in layer:
                sl.dtype = _DTYPES[{"f32": 1, "bf16": 2}[self.dtype]][1]
                sl.per_row_state = _STATE[self.optimizer][1]
                if not started and sl.rows_written != self._phys_rows:
                    if m.base_round:
                        raise _loss("the checkpoint chain is broken: the oldest checkpoint of "
                                    "round %d that holds table '%s' does not hold all of it"
                                    % (m.round, name), sl.path)
                    raise _loss("checkpoint file %s is corrupt: a full checkpoint's slice holds "
                                "%d of the table's %d rows" % (sl.path, sl.rows_written,
                                                               self._phys_rows), sl.path)
            self._layers.append(layer)
            started = True
        self.step = self._layers[-1][0].step
        self.keys = self.slots = None
        if self.kind == "hash":
            keys = _read_index(chain, self.spec)
            self.slots = np.flatnonzero(keys)
            self.keys = keys[self.slots].view(np.int64)
        self.num_rows = len(self.slots) if self.slots is not None else self.spec["rows"]
        dtype = _DTYPES[{"f32": 1, "bf16": 2}[self.dtype]][1]
        self.rows = Rows(self, 0, self.emb_width, dtype)
        names, per_row = _STATE[self.optimizer]
        self.state = {n: Rows(self, i + 1, 0 if per_row else self.emb_width, _F32)
                      for i, n in enumerate(names)}

    def __repr__(self):
        return "Table(%r, %s, %d x %d %s, %s)" % (self.name, self.kind, self.num_rows,
                                                 self.emb_width, self.dtype, self.optimizer)

    def _close(self):
        for layer in self._layers:
            for sl in layer:
                sl.buf = None  # the memory map goes with its last reference
        self._layers = None

    def verify(self):
        """Reads and verifies every block and trailer of the table's files."""
        if self._layers is None:
            raise ValueError("table '%s' of a closed checkpoint" % self.name)
        for layer in self._layers:
            for sl in layer:
                sl.index()
                for b in range(sl.blocks):
                    sl.verify_block(b)

    def _read(self, a, r0, r1, phys):
        """Array a's rows [r0, r1) of the table (phys None), or its rows phys (sorted, distinct).
        Checkpoint by checkpoint, oldest first, so a later one's rows overwrite an earlier one's.
        A large range is read in pieces of about _PIECE_BYTES, each piece all ranks' columns at
        once while its rows are in the cache, the pieces on threads (numpy's copies and zlib's
        crc32 release the GIL)."""
        per_row = a == 1 and _STATE[self.optimizer][1]
        n = (r1 - r0) if phys is None else len(phys)
        dtype = self.rows.dtype if a == 0 else _F32
        out = np.empty((n,) if per_row else (n, self.emb_width), dtype)
        if self._layers is None:
            raise ValueError("table '%s' of a closed checkpoint" % self.name)
        if not n:
            return out
        for layer in self._layers:  # their block indexes, before any thread needs one
            for sl in layer:
                sl.index()
        step = max(1, _PIECE_BYTES // (out.nbytes // n))
        if n <= step:
            self._fill(a, r0, r1, phys, per_row, out)
            return out
        if phys is None:
            pieces = [(p, min(p + step, r1), None, out[p - r0:min(p + step, r1) - r0])
                      for p in range(r0, r1, step)]
        else:
            pieces = [(0, 0, phys[p:p + step], out[p:p + step]) for p in range(0, n, step)]
        list(_pool().map(lambda q: self._fill(a, q[0], q[1], q[2], per_row, q[3]), pieces))
        return out

    def _fill(self, a, r0, r1, phys, per_row, out):
        for layer in self._layers:
            for sl in layer:
                if not (per_row and sl.rank):  # per-row state: rank 0's (every rank's is alike)
                    _fill(sl, a, r0, r1, phys, per_row, out)


_PIECE_BYTES = 4 << 20  # a larger read goes in pieces of this size, on threads
_POOL = []


def _pool():
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor
        _POOL.append(ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                        thread_name_prefix="embps-checkpoint"))
    return _POOL[0]



# ---- checkpoints ---------------------------------------------------------------------------------

class Checkpoint:
    """A complete checkpoint opened by open(): path (its directory), directory (the one holding
    it and its chain), round, base_round (0 when full), group_size (the ranks that wrote it),
    scope ("" for every table, else its one table), time_ms, tables (name -> Table). Indexing by
    a table's name gives the table; a context manager (close() releases the files)."""

    def __init__(self, path, verify=False):
        self.path = path
        self.directory = os.path.dirname(path) or "."
        top = _Manifest(path)
        self.round, self.base_round, self.group_size = top.round, top.base_round, top.group_size
        self.scope, self.time_ms = top.scope, top.time_ms
        chain = [top]
        while chain[0].base_round:
            base, above = chain[0].base_round, chain[0].round
            if base >= above:
                raise _loss("the checkpoint chain is broken: round %d claims to apply on round %d"
                            % (above, base))
            try:
                chain.insert(0, _Manifest(_ckpt_path(self.directory, base)))
            except CheckpointError as e:
                raise _loss("the incremental checkpoint of round %d applies on round %d, which "
                            "cannot be read: %s" % (above, base, e.message), e.file) from None
        self.tables = {name: Table(self, chain, name) for name in top.tables}
        if verify:
            self.verify()

    def __getitem__(self, name):
        try:
            return self.tables[name]
        except KeyError:
            raise CheckpointError(grpc.StatusCode.NOT_FOUND,
                                  "the checkpoint of round %d holds no table '%s' (it holds: %s)"
                                  % (self.round, name, ", ".join(sorted(self.tables)) or "none"),
                                  self.path) from None

    def __contains__(self, name):
        return name in self.tables

    def __iter__(self):
        return iter(self.tables)

    def __repr__(self):
        return "Checkpoint(%r, round=%d, tables=%s)" % (self.path, self.round,
                                                         sorted(self.tables))

    def verify(self):
        """Reads and verifies every block of every table's files (CheckpointError if one fails)."""
        for t in self.tables.values():
            t.verify()

    def close(self):
        """Unmaps the files and drops the tables (arrays returned earlier are copies: they stay
        valid; the tables' views cannot be read any more)."""
        for t in self.tables.values():
            t._close()
        self.tables = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open(path, round=None, verify=False):  # noqa: A001 (embps.checkpoint.open, as the docs say)
    """Opens a complete checkpoint: path is one checkpoint's directory (ckpt-<round>; its parent
    holds its chain) or a checkpoint directory (--checkpoint-dir), of which the checkpoint of
    `round` is opened, or else the newest complete checkpoint of every table (or, when it holds
    none, the newest complete one). verify=True reads and verifies every block now. Raises
    CheckpointError: NOT_FOUND when there is no complete checkpoint there, DATA_LOSS for a corrupt,
    truncated or missing file or a broken chain (naming the file, and the block)."""
    p = os.path.normpath(path)
    if not os.path.isdir(p):
        raise CheckpointError(grpc.StatusCode.NOT_FOUND,
                              "%s is not a directory: name a checkpoint directory or one "
                              "checkpoint's directory (ckpt-<round>) in it" % path, path)
    if os.path.exists(os.path.join(p, MANIFEST)) or _NAME.match(os.path.basename(p)):
        ck = Checkpoint(p, verify)
        if round is not None and ck.round != round:
            raise CheckpointError(grpc.StatusCode.NOT_FOUND, "%s is the checkpoint of round %d, "
                                  "not round %d" % (path, ck.round, round), path)
        return ck
    if round is not None:
        return Checkpoint(_ckpt_path(p, round), verify)
    names = sorted((n for n in os.listdir(p) if _NAME.match(n)), reverse=True)
    newest = None
    for n in names:
        try:
            m = _Manifest(os.path.join(p, n))
        except CheckpointError:
            continue  # incomplete: not a checkpoint
        if m.round != int(_NAME.match(n).group(1)):
            continue  # moved or copied by hand: not the one its name says
        newest = newest or m
        if not m.scope:
            return Checkpoint(m.dir, verify)
    if newest is None and not names:
        raise CheckpointError(grpc.StatusCode.NOT_FOUND,
                              "%s holds no checkpoint: name the servers' --checkpoint-dir or one "
                              "checkpoint's directory (ckpt-<round>) in it" % path, path)
    if newest is None:
        raise CheckpointError(grpc.StatusCode.NOT_FOUND,
                              "%s holds no complete checkpoint (%d checkpoint director%s without a "
                              "complete manifest: cut short, or being written)"
                              % (path, len(names), "y" if len(names) == 1 else "ies"), path)
    return Checkpoint(newest.dir, verify)
