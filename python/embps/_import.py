"""Client.import_array: a (rows, emb_width) array streamed into a table in batches of assigns
(docs/python.md, "Importing an array"), as `embps import` does it from a .npy file.

Conventions, the CLI's (client/cli/cmd_import.c):
  - dtype: float32 rows, or uint16 rows holding bf16 bits (what lookup(dtype="bf16") returns and
    numpy saves for a bf16 table). A bf16 table takes uint16 bits as they are and float32 rounded
    to nearest even; an f32 table takes float32 as it is and bf16 bits widened exactly. Any other
    dtype is refused (convert with array.astype(np.float32)).
  - Without ids, array row i is table row (or hash key) i; a dense table's row 0 is the padding
    row, which every table keeps zeros, so row 0 of the array is not written (a warning says so
    when it is not zeros). With ids, row i goes to ids[i].
  - A table the group lacks is created with the array's shape: dense with rows = len(array)
    without ids, hash-keyed with capacity = len(array) with ids; its dtype is the array's
    (uint16: bf16); the optimizer's defaults.
  - Everything is checked before the first batch leaves (the width, the dtype, the ids' length,
    a dense table's row range), so an array that does not fit writes nothing. A batch that fails
    later leaves the rows before it written: the error says which start resumes (the same rows
    written again are the same bits).

Two batches are kept in flight (assign_async), which overlaps one batch's encoding with the
other's round on the servers; they are sent in order on every rank's channel and ordered like
pushes, so a later batch never lands before an earlier one.
"""
import sys
import time
import warnings

import numpy as np

from . import _arrays
from .errors import Error, ShapeError
from .values import ImportResult

_BATCH_BYTES = 8 << 20
_IN_FLIGHT = 2


def _rows_array(array):
    a = _arrays._tensor_to_numpy(array) if _arrays._is_tensor(array) else array
    if not isinstance(a, np.ndarray):
        a = np.asarray(a)
    if a.ndim != 2:
        raise ShapeError("import: the array must be 2-D, (rows, emb_width), not of shape %s"
                         % (tuple(a.shape),), "reshape it to one row per token")
    if a.dtype == np.dtype("<f4") or a.dtype == np.float32:
        kind = "f32"
    elif a.dtype == np.dtype("<u2") or a.dtype == np.uint16:
        kind = "bf16"
    else:
        raise TypeError("import: the array's dtype is %s; import takes float32 rows, or uint16 "
                        "rows holding bf16 bits: convert it with array.astype(np.float32)"
                        % a.dtype)
    if a.dtype.byteorder == ">":
        raise TypeError("import: the array is big-endian (%s): convert it with "
                        "array.astype(np.%s)" % (a.dtype, "float32" if kind == "f32" else "uint16"))
    return a, kind


def _ids_array(ids, rows):
    a = np.asarray(ids)
    if a.ndim != 1 or a.shape[0] != rows:
        raise ShapeError("import: ids must hold one id per row of the array (%d), not an array "
                         "of shape %s" % (rows, tuple(a.shape)), "pass one id per row")
    if a.dtype.kind not in "iu":
        raise TypeError("import: ids must be integers, not %s" % a.dtype)
    if a.dtype.kind == "u" and a.dtype.itemsize == 8:
        return np.ascontiguousarray(a, dtype="<u8").view("<i8")
    return np.ascontiguousarray(a, dtype="<i8")


def _find(client, table):
    for t in client.tables():
        if t.name == table:
            return t
    return None


def _check(table, spec, a, kind, ids, start):
    rows, width = a.shape
    if width != spec.emb_width:
        raise ShapeError("import: the array's rows hold %d values, but table '%s' has "
                         "emb_width=%d" % (width, table, spec.emb_width),
                         "import an array of emb_width columns")
    if spec.kind == "dense":
        if ids is None and rows > spec.rows:
            raise ShapeError("import: the array has %d rows, but table '%s' has rows=%d: row i "
                             "of the array is table row i" % (rows, table, spec.rows),
                             "import into a table of at least %d rows, or pass ids" % rows)
        if ids is not None and rows > start:
            part = ids[start:]
            bad = np.flatnonzero((part < 0) | (part >= spec.rows))
            if bad.size:
                i = int(bad[0]) + start
                raise ValueError("import: ids[%d] = %d is outside [0, %d) of table '%s': nothing "
                                 "was written" % (i, int(ids[i]), spec.rows, table))
    if ids is None and rows > start and start == 0 and spec.kind == "dense" and a[0].any():
        warnings.warn("import: row 0 of the array is not zeros, and row 0 of table '%s' is the "
                      "padding row, which is not written; pass ids to place the rows elsewhere"
                      % table, stacklevel=3)


class _Progress:
    def __init__(self, table, total, first, show):
        self.table, self.total, self.first, self.show = table, total, first, show
        self.t0 = time.monotonic()
        self.last = 0.0

    def update(self, done, final=False):
        now = time.monotonic()
        if not self.show or (not final and now - self.last < 0.2):
            return
        self.last = now
        rate = (done - self.first) / max(now - self.t0, 1e-9)
        pct = 100.0 * done / self.total if self.total else 100.0
        sys.stderr.write("\rimport %s: %d/%d rows (%.1f%%), %.0f rows/s%s"
                         % (self.table, done, self.total, pct, rate, "\n" if final else ""))
        sys.stderr.flush()


def import_array(client, table, array, ids, start, batch_rows, reset_state, progress):
    if not isinstance(table, str) or not table:
        raise ValueError("import: no table name")
    a, kind = _rows_array(array)
    rows, width = a.shape
    if ids is not None:
        ids = _ids_array(ids, rows)
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or not \
            0 <= start <= rows:
        raise ValueError("import: start=%r is not a row of the array: give 0 to %d" % (start, rows))
    start = int(start)
    g = client.group_size
    if batch_rows is None:
        batch_rows = max(1, _BATCH_BYTES // max(1, width * a.dtype.itemsize))
    if not isinstance(batch_rows, (int, np.integer)) or batch_rows < 1:
        raise ValueError("import: batch_rows=%r must be a positive number of rows" % (batch_rows,))
    batch_rows = max(g, int(batch_rows) // g * g)  # whole shards; the last batch is padded
    spec = _find(client, table)
    created = False
    if spec is None:
        if rows == 0:
            raise ShapeError("import: the array has no rows to create table '%s' from" % table,
                             "import a non-empty array")
        if ids is None:
            spec = client.create_table(table, rows=rows, emb_width=width, dtype=kind)
        else:
            spec = client.create_table(table, capacity=rows, emb_width=width, dtype=kind)
        created = True
    _check(table, spec, a, kind, ids, start)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = _Progress(table, rows, start, show)
    assigned = refused = 0
    inflight = []  # (future, the start that resumes after it)
    done = start

    def settle(fut, lo, hi):
        nonlocal assigned, refused, done
        try:
            r = fut.result()
        except Error as e:
            e.next_start = lo
            e.message = ("%s (import of table '%s' stopped: rows [%d, %d) of the array were "
                         "written; import_array(..., start=%d) resumes)"
                         % (e.message, table, start, lo, lo))
            e.args = (e.message,)
            raise
        assigned += r.num_assigned
        refused += r.num_refused
        done = hi
        bar.update(done)

    try:
        for lo in range(start, rows, batch_rows):
            hi = min(rows, lo + batch_rows)
            n = hi - lo
            tok = np.arange(lo, hi, dtype="<i8") if ids is None else ids[lo:hi]
            chunk = np.ascontiguousarray(a[lo:hi])
            pad = -n % g
            if pad:  # padding token 0 with a zero row: skipped by the servers
                tok = np.concatenate([tok, np.zeros(pad, "<i8")])
                chunk = np.concatenate([chunk, np.zeros((pad, width), chunk.dtype)])
            if len(inflight) >= _IN_FLIGHT:
                settle(*inflight.pop(0))
            inflight.append((client.assign_async(table, tok, chunk, reset_state), lo, hi))
        while inflight:
            settle(*inflight.pop(0))
    finally:
        for fut, _, _ in inflight:
            fut.cancel()
    bar.update(done, final=True)
    return ImportResult(rows=rows - start, num_assigned=assigned, num_refused=refused,
                        created=created, next_start=done)
