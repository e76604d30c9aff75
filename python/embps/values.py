"""The plain values that embps.Client returns: tables, push and assign results, statistics,
health and checkpoints. All are frozen dataclasses built from the servers' replies; names follow the proto
(proto/embps/v1/embps.proto) and the C client (client/embps.h)."""
import dataclasses
from typing import Tuple

DTYPES = {1: "f32", 2: "bf16"}  # embps.v1.DType numbers (checked against proto/ in _names.py)
OPTIMIZERS = {0: "rowwise_adagrad", 1: "sgd", 2: "adagrad", 3: "rowwise_adagrad", 4: "adam"}
EVICTIONS = {0: "lru", 1: "lru", 2: "lfu", 3: "ttl"}  # embps.v1.Eviction numbers (0: the default)


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A table as the group holds it (zero floats mean the optimizer's defaults).

    kind: "dense" (rows, tokens in [0, rows)) or "hash" (capacity slots, any 64-bit id a key).
    The hash-keyed settings (admit_after, eviction, half_life_steps, ttl_steps, sketch_width) are
    0, "lru" and 0 for a dense table."""
    name: str
    rows: int
    emb_width: int
    dtype: str  # "f32" or "bf16"
    optimizer: str  # "sgd", "adagrad", "rowwise_adagrad" or "adam"
    lr: float = 0.0
    eps: float = 0.0
    half_life: float = 0.0
    initial_accumulator: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    seed: int = 0
    init_scale: float = 0.0
    capacity: int = 0
    admit_after: int = 0
    eviction: str = "lru"
    half_life_steps: int = 0
    ttl_steps: int = 0
    sketch_width: int = 0

    @property
    def kind(self):
        """"hash" for a hash-keyed table (capacity > 0), else "dense"."""
        return "hash" if self.capacity else "dense"

    @classmethod
    def from_pb(cls, s):
        o = s.optimizer
        return cls(name=s.name, rows=s.rows, emb_width=s.emb_width,
                   dtype=DTYPES.get(s.dtype, "f32"), optimizer=OPTIMIZERS.get(o.kind, str(o.kind)),
                   lr=o.lr, eps=o.eps, half_life=o.half_life,
                   initial_accumulator=o.initial_accumulator, weight_decay=o.weight_decay,
                   beta1=o.beta1, beta2=o.beta2, seed=s.seed, init_scale=s.init_scale,
                   capacity=s.capacity, admit_after=s.admit_after,
                   eviction=EVICTIONS.get(s.eviction, str(s.eviction)),
                   half_life_steps=s.half_life_steps, ttl_steps=s.ttl_steps,
                   sketch_width=s.sketch_width)


@dataclasses.dataclass(frozen=True)
class PushResult:
    """A push's reply, joined over the ranks as the C client joins it.

    applied: the update was applied (sync). skipped: a non-finite gradient gated the whole step,
    nothing changed. ordered: an async push was ordered (not yet applied; every later lookup
    sees it). grad_norm: L2 norm of the summed gradients, num_unique: distinct non-padding
    tokens (sync only; 0 for async). replayed: this answer is the group's record of an earlier
    attempt of the same batch, which it had applied (or ordered) already; nothing was applied
    again (the push took effect once). attempts: how many times the batch was sent (1: no
    retry)."""
    applied: bool
    skipped: bool
    ordered: bool
    grad_norm: float
    num_unique: int
    batch_id: int
    replayed: bool = False
    attempts: int = 1


@dataclasses.dataclass(frozen=True)
class AssignResult:
    """An assign's reply, joined over the ranks (every rank reports the same).

    num_assigned: distinct nonzero tokens whose rows were written (a token given twice took its
    last row). num_refused: of a hash-keyed table, distinct keys given no slot (every slot was
    held by a key of this batch); their rows were not written. replayed: an earlier attempt of
    this batch had been applied; nothing was written again, and the counts are its. batch_id,
    attempts: as PushResult's."""
    num_assigned: int
    num_refused: int
    batch_id: int
    replayed: bool = False
    attempts: int = 1


@dataclasses.dataclass(frozen=True)
class ImportResult:
    """What import_array wrote: rows, the array's rows sent (from start on, padding row 0 of a
    table without ids left out); num_assigned and num_refused, summed over the batches' assigns
    (AssignResult's); created: the table did not exist and was created with the array's shape;
    next_start: the start that resumes after the last row written (the array's length when
    complete)."""
    rows: int
    num_assigned: int
    num_refused: int
    created: bool
    next_start: int


@dataclasses.dataclass(frozen=True)
class TableStep:
    """One table's optimizer step in a push_features: every feature of the table contributed
    its gradients (expanded to its ids) to this one step, gated alone (docs/design.md, "Feature
    batches"). applied, skipped, grad_norm, num_unique: as PushResult's, for this table."""
    table: str
    applied: bool
    skipped: bool
    grad_norm: float
    num_unique: int


@dataclasses.dataclass(frozen=True)
class PushFeaturesResult:
    """A push_features reply, joined over the ranks.

    steps: one TableStep per table the push touched, in the order the request first names
    them (sync only: empty for an async push, which says ordered, and for a replayed one).
    ordered: an async push was ordered (every later lookup sees it). replayed: an earlier
    attempt of this batch had been applied; nothing was applied again (the group keeps no
    per-table result for it, so steps is empty). batch_id, attempts: as PushResult's.
    applied: every table's step was applied (sync); skipped: some table's step was skipped (a
    non-finite gradient gated it). step(table): that table's TableStep (KeyError if none)."""
    steps: Tuple[TableStep, ...]
    ordered: bool
    replayed: bool
    batch_id: int
    attempts: int = 1

    @property
    def applied(self):
        return bool(self.steps) and all(s.applied for s in self.steps)

    @property
    def skipped(self):
        return any(s.skipped for s in self.steps)

    def step(self, table):
        for s in self.steps:
            if s.table == table:
                return s
        raise KeyError(table)


@dataclasses.dataclass(frozen=True)
class TableStats:
    """One table's counters on one rank. A hash-keyed table's (all 0 for a dense one): capacity
    (slots), keys (stored now), and since its creation keys_admitted, keys_evicted, keys_expired
    (ttl), keys_refused (no slot in their step) and gradients_dropped ((key, push step) pairs
    whose gradients were dropped: not admitted yet, or refused). Every rank keeps the same
    index, so every rank reports the same numbers."""
    name: str
    rows: int
    emb_width: int
    lookups: int
    pushes: int
    rows_looked_up: int
    rows_pushed: int
    steps_applied: int
    steps_skipped: int
    bytes: int  # table and optimizer state held by this rank
    capacity: int = 0
    keys: int = 0
    keys_admitted: int = 0
    keys_evicted: int = 0
    keys_expired: int = 0
    keys_refused: int = 0
    gradients_dropped: int = 0

    @property
    def kind(self):
        """"hash" for a hash-keyed table (capacity > 0), else "dense"."""
        return "hash" if self.capacity else "dense"


@dataclasses.dataclass(frozen=True)
class RankStats:
    """One rank's statistics (GetStats) and the address this client used for it."""
    rank: int
    group_size: int
    address: str
    backend: str  # "cpu" or "cuda"
    version: str
    uptime_s: float
    requests: int
    errors: int
    bytes_in: int
    bytes_out: int
    connections: int
    ready: bool  # the whole group is up
    mesh: str  # e.g. "shard=4"
    peer_bytes_sent: int
    peer_bytes_received: int
    collective_calls: int
    tables: Tuple[TableStats, ...]

    @classmethod
    def from_pb(cls, m, address):
        tables = tuple(TableStats(name=t.name, rows=t.rows, emb_width=t.emb_width,
                                  lookups=t.lookups, pushes=t.pushes,
                                  rows_looked_up=t.rows_looked_up, rows_pushed=t.rows_pushed,
                                  steps_applied=t.steps_applied, steps_skipped=t.steps_skipped,
                                  bytes=t.bytes, capacity=t.capacity, keys=t.keys,
                                  keys_admitted=t.keys_admitted, keys_evicted=t.keys_evicted,
                                  keys_expired=t.keys_expired, keys_refused=t.keys_refused,
                                  gradients_dropped=t.gradients_dropped) for t in m.tables)
        return cls(rank=m.rank, group_size=m.group_size, address=address, backend=m.backend,
                   version=m.version, uptime_s=m.uptime_s, requests=m.requests, errors=m.errors,
                   bytes_in=m.bytes_in, bytes_out=m.bytes_out, connections=m.connections,
                   ready=m.ready, mesh=m.mesh, peer_bytes_sent=m.peer_bytes_sent,
                   peer_bytes_received=m.peer_bytes_received,
                   collective_calls=m.collective_calls, tables=tables)


@dataclasses.dataclass(frozen=True)
class Health:
    """Every rank's grpc.health.v1 answer. True (bool(h)) when every rank is SERVING.

    statuses: one of "SERVING", "NOT_SERVING", "UNKNOWN", "SERVICE_UNKNOWN" per rank, in rank
    order. message: "" when serving, else which rank is not (as the C client says it)."""
    serving: bool
    statuses: Tuple[str, ...]
    message: str

    def __bool__(self):
        return self.serving


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint. round: the tables as they stood after this round; bytes: every
    rank's files; path: its directory on the servers; scope: "" for every table, else the one
    table. From checkpoints() only (0 or empty from checkpoint()): time_unix_ms, group_size (the
    ranks that wrote it; any group size restores it), base_round (incremental: the checkpoint it
    applies on; 0 when full), tables."""
    round: int
    bytes: int
    path: str
    scope: str = ""
    time_unix_ms: int = 0
    group_size: int = 0
    base_round: int = 0
    tables: Tuple[str, ...] = ()
