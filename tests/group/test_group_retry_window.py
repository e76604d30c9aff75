"""The retry window in checkpoints (issue 30; docs/checkpoint-format.md, "The retry window").

- Every checkpoint holds RETRY_WINDOW, written by the leader before the manifest, which lists it
  (rank 0, the empty table name) with its size; the file verifies as the format says (magic,
  version, the manifest's round, zlib's crc32 over every byte before it). A corrupt, truncated or
  missing one stops the restore naming the file.
- Exactly once across a restore, 2 ranks: a sync push with a client id and digest (attempt 0) is
  applied; a checkpoint; another push; the group stops; a group restores that checkpoint. The
  first push retried (attempt 1) is answered replayed=true with the first attempt's answer, the
  table bitwise unchanged; the second, applied after the checkpoint and so lost by the restore,
  is applied again when retried (replayed=false), leaving the table bitwise what the first group
  had; retried once more it is replayed. The window file holds what the format says it holds.
- A checkpoint of one table keeps that table's entries only.

The exactly-once tests need the rounds to check and record pushes (server/group/rounds.c)."""
import os
import struct
import unittest
import zlib

import numpy as np

import grouplib as gl
from grouplib import pb

try:
    import xxhash
except ImportError:  # the server does not recompute digests: any nonzero value names a batch
    xxhash = None

WIDTH = 64
ROWS = 32
T = 8
CLIENT = 77


def digest(table, tokens):
    """The batch's digest as the clients compute it (XXH3-64 over the table's name, T and the
    tokens); a fixed hash of the same bytes where python3-xxhash is missing."""
    tok = np.asarray(tokens, dtype="<i8")
    data = table.encode() + struct.pack("<I", len(tok)) + tok.tobytes()
    d = xxhash.xxh3_64_intdigest(data) if xxhash else zlib.crc32(data) | (1 << 40)
    return d or 1


def push(client, table, batch_id, tokens, grads, attempt):
    """One sync push of (CLIENT, batch_id) with its digest; returns every rank's response."""
    tok = np.asarray(tokens, dtype="<i8")
    g = np.asarray(grads, dtype="<f4")
    s = len(tok) // client.n
    futs = [client.stubs[r].PushGradients.future(pb.PushGradientsRequest(
        table=table, batch_id=batch_id, shard_index=r, shard_count=client.n,
        tokens_per_batch=len(tok), tokens=tok[r * s:(r + 1) * s].tobytes(), dtype=pb.DTYPE_F32,
        gradients=g[r * s:(r + 1) * s].tobytes(), mode=pb.UPDATE_MODE_SYNC, client_id=CLIENT,
        digest=digest(table, tok), attempt=attempt), timeout=gl.CALL_TIMEOUT)
        for r in range(client.n)]
    return [f.result() for f in futs]


def answer(resps):
    return [(r.applied, r.grad_norm, r.num_unique) for r in resps]


def rows(client, table):
    return client.lookup_bytes(table, np.arange(ROWS))


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, ROWS, size=T), rng.normal(size=(T, WIDTH)).astype(np.float32)


def checkpoint(client, table=""):
    return client.stubs[0].Checkpoint(pb.CheckpointRequest(table=table), timeout=gl.CALL_TIMEOUT)


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def manifest_files(path):
    """The manifest's files as (rank, table, bytes), its round, checked as the format says."""
    b = read_bytes(os.path.join(path, "MANIFEST"))
    version = struct.unpack_from("<I", b, 8)[0]
    assert b[:8] == b"EMBPSMAN" and version in (1, 2)
    assert zlib.crc32(b[:-4]) == struct.unpack_from("<I", b, len(b) - 4)[0]
    off = 16
    rnd = struct.unpack_from("<Q", b, off)[0]
    off += 8 * 3 + 4  # round, base_round, time_ms, group_size

    def name(o):
        n = struct.unpack_from("<I", b, o)[0]
        return b[o + 4:o + 4 + n].decode(), o + 4 + n

    _, off = name(off)  # scope
    off += 8  # bytes
    ntables = struct.unpack_from("<I", b, off)[0]
    off += 4
    for _ in range(ntables):  # table specs: name, then fixed fields up to the files
        _, off = name(off)
        off += 8 + 4 + 4 + 8 + 4 + 4 + 7 * 4  # version 1's settings
        if version >= 2:  # the hash-keyed table's: capacity .. sketch_width
            off += 8 + 4 + 4 + 8 + 8 + 4
    nfiles = struct.unpack_from("<I", b, off)[0]
    off += 4
    files = []
    for _ in range(nfiles):
        rank = struct.unpack_from("<I", b, off)[0]
        table, off = name(off + 4)
        files.append((rank, table, struct.unpack_from("<Q", b, off)[0]))
        off += 8
    assert off == len(b) - 4, "the manifest's layout is not the one documented"
    return rnd, files


def parse_window(path):
    """RETRY_WINDOW as docs/checkpoint-format.md lays it out: (round, window, clients), each
    client (id, last_round, floor or None, [(batch, digest, round, norm, unique, table, flags)])."""
    b = read_bytes(path)
    assert b[:8] == b"EMBPSRTW", "no magic"
    assert zlib.crc32(b[:-4]) == struct.unpack_from("<I", b, len(b) - 4)[0], "crc32"
    version, rnd, window, nnames, nclients = struct.unpack_from("<IQIII", b, 8)
    assert version == 1
    off, names = 32, []
    for _ in range(nnames):
        n = struct.unpack_from("<I", b, off)[0]
        names.append(b[off + 4:off + 4 + n].decode())
        off += 4 + n
    clients = []
    for _ in range(nclients):
        cid, last, floor, flags, n = struct.unpack_from("<QQQII", b, off)
        off += 32
        entries = []
        for _ in range(n):
            bt, dg, r, norm, uniq, table, ef = struct.unpack_from("<QQQdQII", b, off)
            entries.append((bt, dg, r, norm, uniq, names[table], ef))
            off += 48
        clients.append((cid, last, floor if flags & 1 else None, entries))
    assert off == len(b) - 4, "the window's layout is not the one documented"
    return rnd, window, clients


class TmpDirs(gl.TmpDirs):
    tmp_prefix = "embps-rtw-"



class WindowFileTest(TmpDirs, unittest.TestCase):
    """The file itself: in every checkpoint, listed, verified; corruption stops a restore."""

    def written(self, n=2):
        d = self.tmpdir()
        group = gl.Group(n, "--checkpoint-dir", d, "--retry-window", "8")
        client = gl.RawClient(group.addresses)
        try:
            client.create("f", ROWS, WIDTH, "sgd")
            tokens, grads = batch(1)
            push(client, "f", 1, tokens, grads, 0)
            path = checkpoint(client).path
        finally:
            client.close()
            group.close_checked(self)
        return path

    def test_listed_and_verified(self):
        path = self.written()
        rnd, files = manifest_files(path)
        size = os.path.getsize(os.path.join(path, "RETRY_WINDOW"))
        self.assertIn((0, "", size), files)
        self.assertEqual(sum(1 for f in files if f[1] == ""), 1, files)
        wrnd, window, _ = parse_window(os.path.join(path, "RETRY_WINDOW"))
        self.assertEqual(wrnd, rnd)
        self.assertEqual(window, 8)
        self.assertEqual(os.path.basename(path), "ckpt-%020d" % rnd)

    def restore_fails(self, path, *frags):
        code, out = gl.start_expecting_failure(["--listen", "127.0.0.1:0", "--restore", path])
        self.assertEqual(code, 1, out)
        for f in frags:
            self.assertIn(f, out)

    def test_corrupt_truncated_missing(self):
        path = self.written(1)
        victim = os.path.join(path, "RETRY_WINDOW")
        good = read_bytes(victim)
        data = bytearray(good)
        data[14] ^= 0x40  # inside the round: only the crc32 can tell
        with open(victim, "wb") as f:
            f.write(data)
        self.restore_fails(path, victim, "crc32")
        with open(victim, "wb") as f:
            f.write(good[:-3])
        self.restore_fails(path, victim, "bytes; its manifest says %d" % len(good))
        os.unlink(victim)
        self.restore_fails(path, victim, "missing")
        with open(victim, "wb") as f:  # and the checkpoint is whole again
            f.write(good)
        group = gl.Group(1, "--restore", path)
        try:
            self.assertEqual(gl.health(group.addresses[0]), gl.SERVING)
        finally:
            group.close_checked(self)


class ExactlyOnceAcrossRestoreTest(TmpDirs, unittest.TestCase):
    """A retry after a restore: recognised if the checkpoint holds the push, applied if not."""

    def test_retry_after_restore(self):
        d = self.tmpdir()
        first = gl.Group(2, "--checkpoint-dir", d)
        client = gl.RawClient(first.addresses)
        t1, g1 = batch(1)
        t2, g2 = batch(2)
        try:
            client.create("w", ROWS, WIDTH, "adagrad", lr=0.1, init_acc=0.1)
            a1 = push(client, "w", 1, t1, g1, 0)
            self.assertTrue(all(r.applied and not r.replayed for r in a1), a1)
            # Retried before any restore, it is recognised too (the window, live).
            again = push(client, "w", 1, t1, g1, 1)
            self.assertTrue(all(r.replayed for r in again), again)
            self.assertEqual(answer(again), answer(a1))
            path = checkpoint(client).path
            at_ckpt = rows(client, "w")
            a2 = push(client, "w", 2, t2, g2, 0)  # after the checkpoint: the restore loses it
            self.assertTrue(all(r.applied and not r.replayed for r in a2), a2)
            final = rows(client, "w")
        finally:
            client.close()
            first.close_checked(self)

        # What the checkpoint's window holds: batch 1 of client 77 on table w, with its answer.
        rnd, _, clients = parse_window(os.path.join(path, "RETRY_WINDOW"))
        self.assertEqual(len(clients), 1, clients)
        cid, last, floor, entries = clients[0]
        self.assertEqual((cid, floor), (CLIENT, None))
        self.assertEqual([(e[0], e[1], e[5]) for e in entries], [(1, digest("w", t1), "w")])
        self.assertLessEqual(entries[0][2], rnd)
        self.assertEqual(entries[0][3], a1[0].grad_norm)
        self.assertEqual(entries[0][4], a1[0].num_unique)
        self.assertEqual(entries[0][6], 1)  # applied

        second = gl.Group(2, "--restore", path, "--checkpoint-dir", self.tmpdir())
        client = gl.RawClient(second.addresses)
        try:
            self.assertEqual(rows(client, "w"), at_ckpt)
            r1 = push(client, "w", 1, t1, g1, 1)
            self.assertTrue(all(r.replayed for r in r1), r1)
            self.assertEqual(answer(r1), answer(a1))
            self.assertEqual(rows(client, "w"), at_ckpt, "a replayed push changed the table")
            r2 = push(client, "w", 2, t2, g2, 1)
            self.assertTrue(all(r.applied and not r.replayed for r in r2), r2)
            self.assertEqual(answer(r2), answer(a2))
            self.assertEqual(rows(client, "w"), final,
                             "the push lost by the restore, applied again, differs")
            r2b = push(client, "w", 2, t2, g2, 2)
            self.assertTrue(all(r.replayed for r in r2b), r2b)
            self.assertEqual(rows(client, "w"), final)
        finally:
            client.close()
            second.close_checked(self)

    def test_scoped_checkpoint_keeps_its_table(self):
        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            client.create("a", ROWS, WIDTH, "sgd")
            client.create("b", ROWS, WIDTH, "sgd")
            ta, ga = batch(3)
            tb, gb = batch(4)
            push(client, "a", 10, ta, ga, 0)
            push(client, "b", 11, tb, gb, 0)
            scoped = checkpoint(client, "a").path
            whole = checkpoint(client).path
        finally:
            client.close()
            group.close_checked(self)
        _, _, clients = parse_window(os.path.join(scoped, "RETRY_WINDOW"))
        self.assertEqual([[e[0] for e in c[3]] for c in clients], [[10]])
        self.assertEqual([e[5] for e in clients[0][3]], ["a"])
        _, _, clients = parse_window(os.path.join(whole, "RETRY_WINDOW"))
        self.assertEqual([[e[0] for e in c[3]] for c in clients], [[10, 11]])


if __name__ == "__main__":
    unittest.main()
