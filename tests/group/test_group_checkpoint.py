"""Checkpoints through real server processes (DESIGN.md, Durability; issue 9).

- Reshard: tables of every optimizer in f32 and bf16, written by 1, 2 and 4 ranks, restored by
  1, 2, 3 and 4: every row bitwise what was checkpointed, and the next push after the restore
  bitwise what the writing group computed (so optimizer state and step counts came back too).
- Incremental chains: restored through the chain onto another group size, bitwise.
- A checkpoint taken while pushes stream in is one point of the round order: each push is in it
  whole or not at all, and the pushes in it are a prefix of those sent (the copy-on-write
  capture copies a row block before a later push writes it).
- kill -9 of every rank at random moments, many times, in the middle of checkpoint writes too:
  each restart restores the latest complete checkpoint, bitwise equal to a reference group that
  ran the same pushes up to that checkpoint.
- SIGTERM under concurrent sync and async pushes: every acknowledged push is in the final
  checkpoint, and the rank exits 0 within its drain timeout.
- Faults and bad input: a missing directory, two groups in one directory, a corrupt or truncated
  file, a missing file, a full disk (a small tmpfs), a checkpoint of another format version, a
  table beyond the restoring rank's --max-memory-bytes.

The widths are multiples of 32 * 12, so that every group size here splits them into whole
row-statistics blocks and a push computes bitwise the same on any of them."""
import glob
import os
import random
import shutil
import signal
import struct
import subprocess
import threading
import time
import unittest
import zlib

import numpy as np

import grouplib as gl
from grouplib import pb

WIDTH = 384
ROWS = 96  # a multiple of every group size here, so one lookup reads every row
OPTS = {
    "sgd": dict(lr=0.05, wd=0.01),
    "adagrad": dict(lr=0.05, half_life=10.0, init_acc=0.1, wd=0.01),
    "rowwise_adagrad": dict(lr=0.05, half_life=5.0, wd=0.001),
    "adam": dict(lr=0.01, b1=0.9, b2=0.999, wd=0.01),
}
DTYPES = {"f32": pb.DTYPE_F32, "bf16": pb.DTYPE_BF16}
T = 24  # tokens per push: divisible by 1, 2, 3 and 4


def to_bf16_bits(a):
    u = np.asarray(a, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def pushes(seed, count, rows=ROWS, width=WIDTH, bf16=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        tokens = rng.integers(0, rows, size=T)
        tokens[3] = tokens[5]  # a duplicate
        grads = rng.normal(size=(T, width)).astype(np.float32)
        out.append((tokens, to_bf16_bits(grads) if bf16 else grads))
    return out


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path, data):
    with open(path, "wb") as f:
        f.write(data)


def table_names():
    return ["t_%s_%s" % (opt, dt) for dt in DTYPES for opt in OPTS]


def create_tables(client):
    for dt, code in DTYPES.items():
        for opt, kw in OPTS.items():
            client.create("t_%s_%s" % (opt, dt), ROWS, WIDTH, opt, seed=11, dtype=code, **kw)


def all_rows(client, name, rows=ROWS):
    return client.lookup_bytes(name, np.arange(rows))


def snapshot(client):
    return {name: all_rows(client, name) for name in table_names()}


def push_all(client, seed, count):
    for i, name in enumerate(table_names()):
        for tokens, grads in pushes(seed * 100 + i, count, bf16=name.endswith("bf16")):
            client.push(name, tokens, grads)


def checkpoint(client, table="", rank=0):
    return client.stubs[rank].Checkpoint(pb.CheckpointRequest(table=table),
                                         timeout=gl.CALL_TIMEOUT)


def ckpt_dirs(d):
    return sorted(p for p in glob.glob(os.path.join(d, "ckpt-*")) if os.path.isdir(p))


class TmpDirs(gl.TmpDirs):
    tmp_prefix = "embps-ckpt-"



class ReshardTest(TmpDirs, unittest.TestCase):
    """Written by N ranks, restored by M: rows and the next push bitwise the writer's."""

    def written_by(self, n):
        d = self.tmpdir()
        group = gl.Group(n, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            create_tables(client)
            push_all(client, 1, 3)
            resp = checkpoint(client)
            self.assertTrue(os.path.isfile(os.path.join(resp.path, "MANIFEST")), resp.path)
            self.assertGreater(resp.bytes, 0)
            before = snapshot(client)
            push_all(client, 2, 1)  # the push every restored group must repeat bitwise
            after = snapshot(client)
        finally:
            client.close()
            group.close_checked(self)
        return resp.path, before, after

    def restore_onto(self, m, path, before, after):
        group = gl.Group(m, "--restore", path, "--checkpoint-dir", self.tmpdir())
        client = gl.RawClient(group.addresses)
        try:
            got = snapshot(client)
            for name in table_names():
                self.assertEqual(got[name], before[name],
                                 "%s restored onto %d ranks differs" % (name, m))
            push_all(client, 2, 1)
            got = snapshot(client)
            for name in table_names():
                self.assertEqual(got[name], after[name],
                                 "%s: the push after a restore onto %d ranks differs" % (name, m))
        finally:
            client.close()
            group.close_checked(self)

    def check_writer(self, n):
        path, before, after = self.written_by(n)
        for m in (1, 2, 3, 4):
            with self.subTest(writers=n, readers=m):
                self.restore_onto(m, path, before, after)

    def test_written_by_1(self):
        self.check_writer(1)

    def test_written_by_2(self):
        self.check_writer(2)

    def test_written_by_4(self):
        self.check_writer(4)

    def test_emb_width_that_does_not_split(self):
        """A table of width 20 written by 2 ranks cannot be restored onto 3: DESIGN.md's message,
        and the rank exits instead of serving half a table."""
        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            client.create("narrow", 12, 20, "sgd")
            path = checkpoint(client).path
        finally:
            client.close()
            group.close_checked(self)
        want = gl.design_message("D % N", D=20, N=3)
        procs = []
        ports, offset = gl.pick_ports(3)
        peers = ",".join("127.0.0.1:%d" % p for p in ports)
        for r in range(3):
            procs.append(subprocess.Popen(
                [gl.server_binary(), "--rank", str(r), "--peers", peers, "--peer-port-offset",
                 str(offset), "--restore", path], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            outs.append((p.returncode, out))
        for r, (code, out) in enumerate(outs):
            self.assertEqual(code, 1, "rank %d: %s" % (r, out))
            self.assertIn(want, out, "rank %d" % r)

    def test_table_beyond_the_memory_budget(self):
        """A table larger than the restoring rank's --max-memory-bytes is refused before any is
        created, naming the table and the flag; the rank exits instead of serving without it."""
        d = self.tmpdir()
        group = gl.Group(1, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            client.create("small", 12, 8, "sgd")
            client.create("big", 1000, 8, "sgd")  # 32000 bytes
            path = checkpoint(client).path
        finally:
            client.close()
            group.close_checked(self)
        p = subprocess.run([gl.server_binary(), "--listen", "127.0.0.1:0", "--restore", path,
                            "--max-memory-bytes", "16K"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=60)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("cannot restore table 'big'", p.stdout)
        self.assertIn("more than this rank's memory budget of 16384 (--max-memory-bytes)", p.stdout)


class IncrementalTest(TmpDirs, unittest.TestCase):
    def test_chain_restores_bitwise_onto_other_sizes(self):
        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d, "--checkpoint-full-every", "3",
                         "--checkpoint-keep", "10")
        client = gl.RawClient(group.addresses)
        snaps = []
        try:
            create_tables(client)
            for k in range(4):
                push_all(client, 10 + k, 2 if k % 2 else 1)
                resp = checkpoint(client)
                snaps.append((resp.path, snapshot(client), resp.bytes))
            listing = gl.run_cli(group, "checkpoints")
            self.assertEqual(listing.returncode, 0, listing.stderr)
        finally:
            client.close()
            group.close_checked(self)
        # full, incremental, incremental, full (every 3rd is full)
        kinds = [line.split()[4] for line in listing.stdout.splitlines()[1:]]
        self.assertEqual(kinds[:4], ["full", "incr<-%s" % snaps[0][0][-20:].lstrip("0"),
                                     "incr<-%s" % snaps[1][0][-20:].lstrip("0"), "full"],
                         listing.stdout)
        # An incremental checkpoint writes less than a full one (few rows changed).
        self.assertLess(snaps[1][2], snaps[0][2])
        for idx in (1, 2):
            for m in (1, 3):
                with self.subTest(checkpoint=idx, readers=m):
                    g2 = gl.Group(m, "--restore", snaps[idx][0])
                    c2 = gl.RawClient(g2.addresses)
                    try:
                        got = snapshot(c2)
                    finally:
                        c2.close()
                        g2.close_checked(self)
                    for name in table_names():
                        self.assertEqual(got[name], snaps[idx][1][name], name)


class KillTest(TmpDirs, unittest.TestCase):
    """kill -9 of both ranks at random moments, over and over; every restart restores the latest
    complete checkpoint, which must equal what a reference group computed from the same pushes
    up to that checkpoint. The client pushes and checkpoints one after the other, so the round
    of each checkpoint is known (every push, lookup and checkpoint is one round)."""

    CYCLES = 6
    ROWS = 30000  # big enough that writing a checkpoint takes a while (to be killed in it)
    HOT = 480     # the pushes touch rows [0, HOT) only; the rest stay as initialized
    EVERY = 4     # a checkpoint after every 4 pushes

    def test_kill_nine_restores_latest_complete(self):
        d = self.tmpdir()
        rng = random.Random(os.getpid())
        data = np.random.default_rng(77)
        hot, cold = np.arange(self.HOT), np.arange(self.HOT, self.ROWS - self.ROWS % 2)
        spec = dict(seed=5, lr=0.01, b1=0.9, b2=0.999)
        ref_group = gl.Group(1)
        ref = gl.RawClient(ref_group.addresses)
        plan = []        # every push made, in order
        ref_applied = 0  # pushes the reference has applied
        ref_snaps = {}   # pushes applied -> the reference's hot rows then
        asked = {}       # checkpoint round -> pushes applied before it
        restored_pushes, round_no, kills_in_checkpoint = 0, 0, 0
        try:
            ref.create("k", self.ROWS, 64, "adam", **spec)
            initial_cold = ref.lookup_bytes("k", cold)
            ref_snaps[0] = ref.lookup_bytes("k", hot)
            for cycle in range(self.CYCLES):
                group = gl.Group(2, "--checkpoint-dir", d, "--checkpoint-keep", "2")
                client = gl.RawClient(group.addresses)
                try:
                    if cycle == 0:
                        client.create("k", self.ROWS, 64, "adam", **spec)
                        round_no = 1
                    else:
                        latest = self.latest_complete(d, cycle)
                        self.assertIn(latest, asked, "cycle %d: restored round %d, at which no "
                                      "checkpoint was asked for (%s)" % (cycle, latest,
                                                                         sorted(asked)))
                        restored_pushes = asked[latest]
                        self.assertEqual(client.lookup_bytes("k", hot), ref_snaps[restored_pushes],
                                         "cycle %d: round %d is not the table after %d pushes" %
                                         (cycle, latest, restored_pushes))
                        self.assertEqual(client.lookup_bytes("k", cold), initial_cold)
                        round_no = latest + 2  # the two lookups
                        asked = {r: n for r, n in asked.items() if r <= latest}
                    done = restored_pushes
                    kill_all = lambda: [p.kill() for p in group.procs]  # noqa: E731
                    # Odd cycles kill within the first checkpoint after 0.3 s, while its files
                    # are written; even ones at any moment, but cycle 0 only once its first
                    # checkpoint is complete: cycle 1 must have one to restore, however slow
                    # the machine (ThreadSanitizer's build takes over 2 s for the first four
                    # pushes and the checkpoint on a loaded 2-core machine).
                    in_write = cycle % 2 == 1
                    started = time.time()
                    killer = threading.Timer(rng.uniform(0.3, 2.0), kill_all)
                    if not in_write and cycle > 0:
                        killer.start()
                    in_checkpoint = False
                    try:
                        while True:
                            if done == len(plan):
                                plan.append((data.integers(0, self.HOT, size=T),
                                             data.normal(size=(T, 64)).astype(np.float32)))
                            tokens, grads = plan[done]
                            client.push("k", tokens, grads)
                            round_no += 1
                            done += 1
                            if done > ref_applied:
                                ref.push("k", tokens, grads)
                                ref_applied = done
                                if done % self.EVERY == 0:
                                    ref_snaps[done] = ref.lookup_bytes("k", hot)
                            if done % self.EVERY == 0:
                                round_no += 1
                                asked[round_no] = done
                                in_checkpoint = True
                                if in_write and time.time() - started > 0.3:
                                    killer = threading.Timer(rng.uniform(0.0, 0.08), kill_all)
                                    killer.start()
                                checkpoint(client, rank=done // self.EVERY % 2)
                                in_checkpoint = False
                                if cycle == 0 and not killer.is_alive() and \
                                        not killer.finished.is_set():
                                    killer.start()
                    except gl.grpc.RpcError:
                        kills_in_checkpoint += in_checkpoint
                    if killer.is_alive() or killer.finished.is_set():
                        killer.join()
                finally:
                    client.close()
                    for p in group.procs:
                        p.kill()
                    group._kill_all()
            self.assertGreater(kills_in_checkpoint, 0, "no kill landed in a checkpoint")
        finally:
            ref.close()
            ref_group.close_checked(self)

    def latest_complete(self, d, cycle):
        complete = [p for p in ckpt_dirs(d) if os.path.exists(os.path.join(p, "MANIFEST"))]
        self.assertTrue(complete, "cycle %d: no complete checkpoint in %s" % (cycle, d))
        return int(complete[-1].rsplit("-", 1)[1])


class SigtermTest(TmpDirs, unittest.TestCase):
    def test_acknowledged_pushes_are_in_the_final_checkpoint(self):
        """Concurrent sync and async pushes of SGD steps on disjoint rows; SIGTERM to rank 1 in
        the middle. Every acknowledged push must be in the final checkpoint (its rows moved by
        exactly one step), and rank 1 must exit 0 within its drain timeout."""
        d = self.tmpdir()
        rows, width, lr = 4800, 32, 0.5
        group = gl.Group(2, "--checkpoint-dir", d, "--drain-timeout-ms", "8000")
        client = gl.RawClient(group.addresses)
        client.create("s", rows, width, "sgd", lr=lr, seed=3)
        initial = np.frombuffer(client.lookup_bytes("s", np.arange(rows)), "<f4").reshape(rows,
                                                                                          width)
        acked, lock = [], threading.Lock()

        def pusher(k):
            mode = pb.UPDATE_MODE_ASYNC if k % 2 else pb.UPDATE_MODE_SYNC
            for i in range(1, 10000):
                base = (i * 4 + k) * 24
                if base + 24 > rows:
                    return
                tokens = np.arange(base, base + 24)
                try:
                    client.push("s", tokens, np.ones((24, width), np.float32), mode=mode)
                except gl.grpc.RpcError:
                    return
                with lock:
                    acked.append(base)

        threads = [threading.Thread(target=pusher, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.4)
        t0 = time.time()
        os.kill(group.procs[1].pid, signal.SIGTERM)
        code = group.procs[1].wait(15.0)
        took = time.time() - t0
        for t in threads:
            t.join(60)
        logs = group.logs()
        client.close()
        group.close()
        self.assertEqual(code, 0, logs)
        self.assertLess(took, 8.0 + 1.0, logs)
        self.assertIn("final checkpoint complete", logs)
        self.assertTrue(acked)
        g2 = gl.Group(1, "--checkpoint-dir", d)
        c2 = gl.RawClient(g2.addresses)
        try:
            got = np.frombuffer(c2.lookup_bytes("s", np.arange(rows)), "<f4").reshape(rows, width)
        finally:
            c2.close()
            g2.close_checked(self)
        stepped = (initial - np.float32(lr) * np.float32(1.0)).astype(np.float32)
        for base in acked:
            r = slice(base, base + 24)
            if base == 0:
                r = slice(1, 24)  # row 0 is the padding row
            np.testing.assert_array_equal(got[r], stepped[r],
                                          "acknowledged push at rows %d.. is lost" % base)
        # nothing was applied twice or anywhere else
        moved = np.any(got != initial, axis=1)
        self.assertTrue(np.all((got[moved] == stepped[moved])))


class FaultTest(TmpDirs, unittest.TestCase):
    def test_directory_missing_or_not_a_directory(self):
        code, out = gl.start_expecting_failure(["--checkpoint-dir", "/nonexistent/embps-ckpt"])
        self.assertEqual(code, 2, out)
        self.assertIn("/nonexistent/embps-ckpt", out)
        self.assertIn("does not exist", out)
        f = os.path.join(self.tmpdir(), "file")
        open(f, "w").close()
        code, out = gl.start_expecting_failure(["--checkpoint-dir", f])
        self.assertEqual(code, 2, out)
        self.assertIn("not a directory", out)

    def test_two_groups_one_directory(self):
        d = self.tmpdir()
        g1 = gl.Group(1, "--checkpoint-dir", d)
        try:
            code, out = gl.start_expecting_failure(["--listen", "127.0.0.1:0", "--checkpoint-dir",
                                                 d])
            self.assertEqual(code, 2, out)
            self.assertIn("in use by another group", out)
            self.assertIn("pid %d" % g1.procs[0].pid, out)
        finally:
            g1.close_checked(self)

    def written(self, n=2):
        d = self.tmpdir()
        group = gl.Group(n, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            client.create("f", ROWS, WIDTH, "adagrad")
            push_all_one(client)
            path = checkpoint(client).path
        finally:
            client.close()
            group.close_checked(self)
        return d, path

    def restore_fails(self, path, *frags):
        code, out = gl.start_expecting_failure(["--listen", "127.0.0.1:0", "--restore", path])
        self.assertEqual(code, 1, out)
        for f in frags:
            self.assertIn(f, out)

    def test_checksums_are_zlibs_crc32(self):
        # The format's checksums are zlib's crc32 (ckpt_codec.c computes them with ISA-L), so any
        # tool can verify a file: the header's, and every block's over its 16 bytes and payload.
        d, path = self.written(1)
        data = read_bytes(os.path.join(path, "r0-f.embps"))
        hlen = struct.unpack_from("<I", data, 12)[0]
        self.assertEqual(zlib.crc32(data[:hlen - 4]), struct.unpack_from("<I", data, hlen - 4)[0])
        off, blocks = hlen, 0
        while data[off:off + 8] != b"EMBPSEND":
            _, _, plen, want = struct.unpack_from("<QIII", data, off)
            self.assertEqual(zlib.crc32(data[off + 20:off + 20 + plen],
                                        zlib.crc32(data[off:off + 16])), want)
            off += 20 + plen
            blocks += 1
        self.assertGreater(blocks, 0)
        self.assertEqual(zlib.crc32(data[off:off + 28]), struct.unpack_from("<I", data, off + 28)[0])

    def test_corrupt_truncated_missing(self):
        d, path = self.written()
        victim = os.path.join(path, "r1-f.embps")
        data = bytearray(read_bytes(victim))
        for where in (len(data) // 2, len(data) - 30):
            bad = bytearray(data)
            bad[where] ^= 0x40
            write_bytes(victim, bad)
            self.restore_fails(path, "r1-f.embps", "crc32")
        write_bytes(victim, data[: len(data) // 3])
        self.restore_fails(path, "r1-f.embps")
        os.unlink(victim)
        self.restore_fails(path, "r1-f.embps")

    def test_other_format_version(self):
        d, path = self.written(1)
        victim = os.path.join(path, "r0-f.embps")
        data = bytearray(read_bytes(victim))
        data[8] ^= 0x07  # the version field follows the 8-byte magic
        write_bytes(victim, data)
        self.restore_fails(path, "version")

    def test_disk_full(self):
        """A checkpoint that fills the disk fails with RESOURCE_EXHAUSTED naming the file; the
        previous checkpoint stays complete and restorable; the group keeps serving."""
        d = self.tmpdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", d],
                          capture_output=True).returncode != 0:
            self.skipTest("cannot mount a small tmpfs here (needs root)")
        try:
            group = gl.Group(1, "--checkpoint-dir", d)
            client = gl.RawClient(group.addresses)
            try:
                client.create("small", 960, 256, "sgd")  # ~1 MiB
                first = checkpoint(client)
                rows = all_rows(client, "small", 960)
                client.create("big", 4800, 256, "sgd")  # ~5 MiB: cannot fit
                err = gl.rpc_error(lambda: checkpoint(client))
                self.assertIsNotNone(err)
                self.assertEqual(err.code(), gl.SC.RESOURCE_EXHAUSTED, err.details())
                self.assertIn("no space left on device writing " + d, err.details())
                # still serving, and the first checkpoint is still the latest complete one
                self.assertEqual(all_rows(client, "small", 960), rows)
                listing = client.stubs[0].ListCheckpoints(pb.ListCheckpointsRequest())
                self.assertEqual([c.round for c in listing.checkpoints], [first.round])
            finally:
                client.close()
                group.close()
            shutil.rmtree(os.path.join(d, "restored"), ignore_errors=True)
            g2 = gl.Group(1, "--restore", first.path)
            c2 = gl.RawClient(g2.addresses)
            try:
                self.assertEqual(all_rows(c2, "small", 960), rows)
            finally:
                c2.close()
                g2.close_checked(self)
        finally:
            subprocess.run(["umount", "-l", d], capture_output=True)

    def test_bad_requests(self):
        d = self.tmpdir()
        group = gl.Group(2, "--checkpoint-dir", d)
        client = gl.RawClient(group.addresses)
        try:
            err = gl.rpc_error(lambda: checkpoint(client))
            self.assertEqual(err.code(), gl.SC.FAILED_PRECONDITION)
            self.assertIn("no tables", err.details())
            client.create("x", 12, 8, "sgd")
            err = gl.rpc_error(lambda: checkpoint(client, table="nope"))
            self.assertEqual(err.code(), gl.SC.NOT_FOUND)
            err = gl.rpc_error(lambda: client.stubs[1].Checkpoint(
                pb.CheckpointRequest(path="/tmp/elsewhere"), timeout=gl.CALL_TIMEOUT))
            self.assertEqual(err.code(), gl.SC.INVALID_ARGUMENT)
            # a rank that is not the leader takes one too, and the CLI says what it wrote
            resp = checkpoint(client, rank=1)
            self.assertTrue(resp.path.startswith(d))
            out = gl.run_cli(group, "checkpoint", "--table", "x")
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("checkpoint complete: round", out.stdout)
        finally:
            client.close()
            group.close_checked(self)


class CutTest(TmpDirs, unittest.TestCase):
    """Checkpoints under a stream of pushes are consistent cuts of the round order."""

    ROWS, WIDTH, P = 1 << 19, 32, 32  # 64 MiB of rows: the writer copies for a while

    def counts(self, w0, w):
        """Pushes each row has seen (sgd, lr 1, gradient 1: each subtracts exactly about 1)."""
        k = np.rint(w0 - w).astype(np.int64)
        self.assertTrue((k == k[:, :1]).all(), "a row was checkpointed half-updated")
        return k[1:, 0]  # row 0 is the padding row

    def rows(self, client):
        step = 1 << 16
        return np.concatenate([client.lookup("cut", np.arange(i, i + step), self.WIDTH)
                               for i in range(0, self.ROWS, step)])

    def test_pushes_are_in_whole_and_in_order(self):
        d = self.tmpdir()
        group = gl.Group(1, "--checkpoint-dir", d, "--checkpoint-keep", "0")
        client = gl.RawClient(group.addresses)
        rows = np.arange(self.ROWS)
        batches = [rows[(rows % self.P == p) & (rows != 0)] for p in range(self.P)]
        ones = np.ones((len(batches[1]), self.WIDTH), np.float32)
        paths, asked = [], threading.Event()
        try:
            client.create("cut", self.ROWS, self.WIDTH, "sgd", lr=1.0, wd=0.0)
            w0 = self.rows(client)

            def take():
                asked.wait()
                for _ in range(3):
                    paths.append(checkpoint(client).path)

            th = threading.Thread(target=take)
            th.start()
            for i in range(4 * self.P):
                if i == 2:
                    asked.set()
                b = batches[i % self.P]
                client.push("cut", b, ones[:len(b)])
                if len(paths) == 3:
                    break
            th.join()
        finally:
            client.close()
            group.close_checked(self)
        self.assertEqual(len(paths), 3)
        for path in paths:
            g2 = gl.Group(1, "--restore", path)
            c2 = gl.RawClient(g2.addresses)
            try:
                k = self.counts(w0, self.rows(c2))
            finally:
                c2.close()
                g2.close_checked(self)
            per_push = [np.unique(k[(rows[1:] % self.P) == p]) for p in range(self.P)]
            for p, u in enumerate(per_push):
                self.assertEqual(len(u), 1, "%s: push class %d is in it only in part" % (path, p))
            seen = np.array([u[0] for u in per_push])
            c = int(seen.sum())  # the pushes before the cut
            want = c // self.P + (np.arange(self.P) < c % self.P)
            self.assertTrue((seen == want).all(),
                            "%s: not a prefix of the pushes: %s" % (path, seen.tolist()))


def push_all_one(client):
    rng = np.random.default_rng(4)
    for _ in range(2):
        tokens = rng.integers(0, ROWS, size=T)
        client.push("f", tokens, rng.normal(size=(T, WIDTH)).astype(np.float32))


if __name__ == "__main__":
    unittest.main()
