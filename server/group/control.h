/* The group's control protocol as bytes: every message that ranks exchange outside the
 * collectives, encoded into and decoded from buffers with no I/O (control_io.h carries them
 * over sockets). Internal to the group layer (embps__ prefix).
 *
 * At bootstrap, on each new connection (bootstrap.c):
 *   connector -> acceptor  hello:   "EMBPS1" | kind u8 | rank u32 | size u32 | identity_len u32
 *                                   | identity bytes
 *   acceptor -> connector  verdict: u8 (0 accept, 1 refuse, 2 challenge) | message_len u16
 *                                   | message
 *   then, on control connections, one READY byte each way once the whole group is connected.
 *
 * With a group secret (secret.h) the acceptor that likes a hello does not accept at once: it
 * sends a challenge (a verdict of 2 whose message is its 32-byte nonce), the connector answers
 *   connector -> acceptor  auth:    nonce 32 bytes | proof 32 bytes
 * and the acceptor refuses (a verdict of 1 naming the failed check) or accepts with a verdict
 * of 0 whose message is its own 32-byte proof, which the connector checks in turn.
 *
 * Afterwards, on the control connections between the leader and every other rank, frames
 *   length u32 (of what follows) | type u8 | payload
 * of the types in embps__frame_type_t. All integers are little-endian (common/byteorder.h);
 * floats travel as their IEEE-754 bits. Both ends run the same version of embps (bootstrap
 * refuses a peer whose version differs before any frame is sent). */
#ifndef EMBPS_GROUP_CONTROL_H
#define EMBPS_GROUP_CONTROL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "server/group/group.h"
#include "server/group/sequencer.h"
#include "server/store/store.h"

/* ---- bootstrap ---- */

/** What every hello starts with, and its length. */
#define EMBPS__HELLO_MAGIC "EMBPS1"
#define EMBPS__HELLO_MAGIC_LEN 6
/** Bytes of a hello before its identity. */
#define EMBPS__HELLO_HEADER_LEN (EMBPS__HELLO_MAGIC_LEN + 1 + 4 + 4 + 4)
/** An identity must be shorter than this. */
#define EMBPS__MAX_IDENTITY_LEN (64u * 1024u)
/** Bytes of a verdict before its message. */
#define EMBPS__VERDICT_HEADER_LEN 3
/** What a decoded verdict says (embps__verdict_decode's *verdict); the first two keep the
 * meaning of the boolean "accept" that came before the challenge. */
#define EMBPS__VERDICT_REFUSED 0
#define EMBPS__VERDICT_ACCEPTED 1
#define EMBPS__VERDICT_CHALLENGE 2
/** Bytes of a nonce and of a proof (an HMAC-SHA256). */
#define EMBPS__NONCE_LEN 32
#define EMBPS__PROOF_LEN 32
/** Bytes of the connector's answer to a challenge: its nonce, then its proof. */
#define EMBPS__AUTH_LEN (EMBPS__NONCE_LEN + EMBPS__PROOF_LEN)
/** Longest verdict message carried (what an embps_error_t holds). */
#define EMBPS__VERDICT_MESSAGE_MAX (sizeof(((embps_error_t *)0)->message) - 1)
/** The byte each rank sends on every control connection once it holds all its connections. */
#define EMBPS__READY_BYTE 'R'

/** A hello's header as received. */
typedef struct embps__hello {
  uint8_t kind; /* EMBPS_GROUP_CONN_CONTROL or _DATA; other values are judged, not refused here */
  uint32_t rank;
  uint32_t size;
  uint32_t identity_len;
} embps__hello_t;

/** A growable byte buffer that encoders append to. data is owned (embps__buf_free). */
typedef struct embps__buf {
  uint8_t *data;
  size_t len, cap;
} embps__buf_t;

/** Frees b's bytes and empties it. */
void embps__buf_free(embps__buf_t *b);

/** Appends a whole hello to b. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT when identity_len is
 * EMBPS__MAX_IDENTITY_LEN or more, or EMBPS_RESOURCE_EXHAUSTED; b keeps its old length on
 * failure. identity is borrowed. */
embps_status_t embps__hello_encode(embps__buf_t *b, uint8_t kind, uint32_t rank, uint32_t size,
                                   const char *identity, size_t identity_len);

/** 1 when the n bytes at p (n may be short of the whole magic) can start a hello, else 0: what
 * lets an acceptor drop a stranger after its first bytes. */
int embps__hello_magic_ok(const uint8_t *p, size_t n);

/** Decodes the EMBPS__HELLO_HEADER_LEN bytes at p. Returns EMBPS_OK, EMBPS_INVALID_ARGUMENT
 * (not a hello: the magic differs) or EMBPS_FAILED_PRECONDITION (a hello announcing an identity
 * of EMBPS__MAX_IDENTITY_LEN bytes or more: err says so, naming the rank, as a refusal). */
embps_status_t embps__hello_decode(const uint8_t *p, embps__hello_t *h, embps_error_t *err);

/** Appends a verdict to b: accept (1) or refuse (0) with message (borrowed, NUL-terminated;
 * clipped to EMBPS__VERDICT_MESSAGE_MAX bytes). Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED. */
embps_status_t embps__verdict_encode(embps__buf_t *b, int accept, const char *message);

/** Appends a verdict whose message is len raw bytes (borrowed): EMBPS__VERDICT_CHALLENGE with a
 * nonce, or EMBPS__VERDICT_ACCEPTED with the acceptor's proof. Returns EMBPS_OK,
 * EMBPS_INVALID_ARGUMENT (another verdict, or len over EMBPS__VERDICT_MESSAGE_MAX) or
 * EMBPS_RESOURCE_EXHAUSTED; b keeps its old length on failure. */
embps_status_t embps__verdict_encode_bytes(embps__buf_t *b, int verdict, const uint8_t *bytes,
                                           size_t len);

/** Decodes the EMBPS__VERDICT_HEADER_LEN bytes at p: *verdict (EMBPS__VERDICT_*) and the
 * length of the message that follows. Returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT when the
 * verdict byte is none of the three, or a challenge's message is not EMBPS__NONCE_LEN bytes. */
embps_status_t embps__verdict_decode(const uint8_t *p, int *verdict, size_t *message_len,
                                     embps_error_t *err);

/** Appends the connector's answer to a challenge (EMBPS__AUTH_LEN bytes): its nonce and its
 * proof (borrowed). Returns EMBPS_OK or EMBPS_RESOURCE_EXHAUSTED (b keeps its old length). */
embps_status_t embps__auth_encode(embps__buf_t *b, const uint8_t *nonce, const uint8_t *proof);

/** Splits the EMBPS__AUTH_LEN bytes at p into nonce and proof (caller's arrays of
 * EMBPS__NONCE_LEN and EMBPS__PROOF_LEN bytes). Every byte string is well-formed: the proof is
 * what is checked (secret.h). */
void embps__auth_decode(const uint8_t *p, uint8_t *nonce, uint8_t *proof);

/* ---- frames on the control connections ---- */

/** The kinds of frame on a control connection (the u8 after the length). */
typedef enum embps__frame_type {
  /** rank -> leader: "I hold my shard of batch B" (an embps_batch_desc_t). */
  EMBPS__FRAME_NOTICE = 1,
  /** leader -> every rank: an ordered list of round entries; a run of a CreateTable carries
   * the table's config. */
  EMBPS__FRAME_ROUND = 2,
  /** either way: the group broke, and a sentence on why. */
  EMBPS__FRAME_BROKEN = 3,
  /** rank -> leader at formation (cuda): the device this rank claims. */
  EMBPS__FRAME_DEVICE = 4,
  /** leader -> every rank at formation (cuda): NCCL's unique id. */
  EMBPS__FRAME_NCCL_ID = 5,
  /** about a checkpoint (an embps__ckpt_msg_t): a rank asks the leader for one, a rank tells the
   * leader its files are durable (or why not), the leader tells every rank it is complete. */
  EMBPS__FRAME_CHECKPOINT = 6,
  /** either way: the sender leaves the group cleanly (it is shutting down), and a sentence
   * naming it. The group cannot serve without it, but nothing failed: the receiver logs it as
   * news, not as an error. */
  EMBPS__FRAME_LEAVING = 7,
  /** rank -> leader: "withdraw my shard of batch (client_id, batch_id, attempt)": its caller
   * went away (reset its stream, or closed its connection) before the batch was ordered
   * (an embps__withdraw_t; embps_sequencer_withdraw). */
  EMBPS__FRAME_WITHDRAW = 8,
  /** through a control relay (relay.h): one whole frame of another type, and a rank. Upward
   * (relay -> leader) the rank is the member the frame came from; downward (leader -> relay)
   * the one rank it is for, the relay itself or one of its members. A frame the leader sends
   * a relay unwrapped is for the relay and every member. Never nested. */
  EMBPS__FRAME_RELAY = 9,
} embps__frame_type_t;

/** The control protocol's version. Ranks agree on it at formation (the identity's `control` key,
 * agreement.c), so a rank whose frames are laid out otherwise is refused by name instead of
 * misreading them: bump it with any change to a frame's layout or a new frame type, even where
 * the release version stays. 2: NOTICE carries the caller's deadline; LEAVING. 3: NOTICE carries
 * the batch's digest and attempt, round entries their attempt; WITHDRAW. 4: a CREATE entry's
 * table settings carry the hash-keyed ones (capacity, admit_after, eviction, half_life_steps,
 * ttl_steps, sketch_width; common/table_fields.h). 5: the op kind ASSIGN (6) in NOTICE and
 * round entries. 6: RELAY, and control relays (the identity's control_fanout key). */
#define EMBPS__CONTROL_VERSION 6

/** Bytes of a frame's header (length and type). */
#define EMBPS__FRAME_HEADER_LEN 5
/** Largest frame payload accepted; a full round of creates is far below it. */
#define EMBPS__FRAME_MAX (4u << 20)
/** Most entries in one round frame. */
#define EMBPS__ROUND_MAX 256
/** Longest reason a BROKEN frame carries. */
#define EMBPS__BROKEN_MAX 300
/** Bytes of NCCL's unique id (EMBPS_NCCL_UNIQUE_ID_BYTES; formation.c checks they agree). */
#define EMBPS__NCCL_ID_BYTES 128

/** What a round entry that runs a checkpoint tells every rank. */
typedef struct embps__ckpt_order {
  char scope[EMBPS_TABLE_NAME_MAX]; /* "": every table; else the one table */
  uint64_t round;                   /* the checkpoint's round: what it is named after */
  uint64_t base_round;              /* incremental: the checkpoint it applies on; 0 when full */
} embps__ckpt_order_t;

/** The kinds of checkpoint message. */
typedef enum embps__ckpt_what {
  EMBPS__CKPT_REQUEST = 1,  /* rank -> leader: take a checkpoint of `scope` (request `seq`) */
  EMBPS__CKPT_DONE = 2,     /* rank -> leader: my files of checkpoint `round` are durable
                               (`bytes`), or not (`status`, `message`) */
  EMBPS__CKPT_COMPLETE = 3, /* leader -> rank: checkpoint `round` is complete at `path`
                               (`bytes` in all) or failed; it answers your requests up to `seq` */
} embps__ckpt_what_t;

/** Longest checkpoint path a message carries. */
#define EMBPS__CKPT_PATH_MAX EMBPS_GROUP_CKPT_PATH_MAX

typedef struct embps__ckpt_msg {
  uint8_t what; /* embps__ckpt_what_t */
  uint64_t seq; /* request: the rank's request number (from 1); complete: 0 for none */
  uint64_t round;
  uint32_t status; /* embps_status_t */
  uint64_t bytes;
  uint8_t final; /* request: the rank is shutting down, and the group with it */
  char scope[EMBPS_TABLE_NAME_MAX];
  char path[EMBPS__CKPT_PATH_MAX];
  char message[sizeof(((embps_error_t *)0)->message)];
} embps__ckpt_msg_t;

/** What a WITHDRAW frame names: the batch whose shard a rank's caller abandoned. */
typedef struct embps__withdraw {
  uint64_t client_id;
  uint64_t batch_id;
  uint32_t attempt;
} embps__withdraw_t;

/** A rank's claim on a CUDA device: which host, which device by PCI bus id and by number. */
typedef struct embps__device_claim {
  char host[256];
  char bus_id[64];
  int32_t device;
} embps__device_claim_t;

/** Decodes a frame header (EMBPS__FRAME_HEADER_LEN bytes at p). Returns EMBPS_OK with the type
 * and payload length, or EMBPS_INVALID_ARGUMENT (a length of 0 or over EMBPS__FRAME_MAX, or a
 * type outside embps__frame_type_t). */
embps_status_t embps__frame_header(const uint8_t *p, uint8_t *type, size_t *payload_len,
                                   embps_error_t *err);

/** Finds the first whole frame in the avail bytes at p. Returns EMBPS_OK with *frame_len the
 * bytes it takes (0: not whole yet, read more) and its type and payload (pointing into p), or
 * the errors of embps__frame_header. */
embps_status_t embps__frame_next(const uint8_t *p, size_t avail, uint8_t *type,
                                 const uint8_t **payload, size_t *payload_len, size_t *frame_len,
                                 embps_error_t *err);

/* Encoders: each appends one whole frame to b and returns EMBPS_OK, EMBPS_INVALID_ARGUMENT
 * (a field that the format cannot carry, named in err) or EMBPS_RESOURCE_EXHAUSTED; on failure
 * b keeps its old length. Arguments are borrowed. */

/** NOTICE: the batch's client id and id, kind, tokens_per_batch, table name and table id, its
 * caller's deadline (a flag byte, then the milliseconds left), its digest and its attempt. */
embps_status_t embps__frame_notice(embps__buf_t *b, const embps_batch_desc_t *d,
                                   embps_error_t *err);

/** ROUND: n (at most EMBPS__ROUND_MAX) entries (each its batch's client id, id and attempt,
 * action, kind, status and message); configs[i] is sent for entries that run a
 * CreateTable or a DropTable (its name), ckpts[i] for entries that run a checkpoint (either may be
 * NULL when no entry needs it). */
embps_status_t embps__frame_round(embps__buf_t *b, const embps_round_entry_t *entries,
                                  const embps_table_config_t *configs,
                                  const embps__ckpt_order_t *ckpts, size_t n, embps_error_t *err);

/** CHECKPOINT: a checkpoint message. */
embps_status_t embps__frame_checkpoint(embps__buf_t *b, const embps__ckpt_msg_t *m,
                                       embps_error_t *err);

/** BROKEN: why (NUL-terminated), clipped to EMBPS__BROKEN_MAX bytes. */
embps_status_t embps__frame_broken(embps__buf_t *b, const char *why, embps_error_t *err);

/** LEAVING: why (NUL-terminated), clipped to EMBPS__BROKEN_MAX bytes. */
embps_status_t embps__frame_leaving(embps__buf_t *b, const char *why, embps_error_t *err);

/** WITHDRAW: the batch whose shard is withdrawn. */
embps_status_t embps__frame_withdraw(embps__buf_t *b, const embps__withdraw_t *w,
                                     embps_error_t *err);

/** RELAY: rank, then the whole frame (header and payload: frame_len bytes at frame) it carries,
 * which must be one well-formed frame of another type than RELAY. */
embps_status_t embps__frame_relay(embps__buf_t *b, uint32_t rank, const uint8_t *frame,
                                  size_t frame_len, embps_error_t *err);

/** DEVICE: a device claim. */
embps_status_t embps__frame_device(embps__buf_t *b, const embps__device_claim_t *c,
                                   embps_error_t *err);

/** NCCL_ID: the EMBPS__NCCL_ID_BYTES bytes of id. */
embps_status_t embps__frame_nccl_id(embps__buf_t *b, const uint8_t *id, embps_error_t *err);

/* Decoders of payloads (what embps__frame_next or embps__frame_header delimited). Each checks
 * every length and field and returns EMBPS_OK, or EMBPS_INVALID_ARGUMENT with err saying what
 * is malformed (outputs are then unspecified). */

/** NOTICE into *d. */
embps_status_t embps__parse_notice(const uint8_t *p, size_t len, embps_batch_desc_t *d,
                                   embps_error_t *err);

/** ROUND into entries[0..*n) and, for entries that run a CreateTable or DropTable, configs[i], for
 * entries that run a checkpoint, ckpts[i]; the arrays hold max entries (a round of more is
 * malformed). */
embps_status_t embps__parse_round(const uint8_t *p, size_t len, embps_round_entry_t *entries,
                                  embps_table_config_t *configs, embps__ckpt_order_t *ckpts,
                                  size_t max, size_t *n, embps_error_t *err);

/** CHECKPOINT into *m. */
embps_status_t embps__parse_checkpoint(const uint8_t *p, size_t len, embps__ckpt_msg_t *m,
                                       embps_error_t *err);

/** BROKEN or LEAVING (the same payload: a sentence) into why (cap bytes, NUL-terminated;
 * clipped). */
embps_status_t embps__parse_broken(const uint8_t *p, size_t len, char *why, size_t cap,
                                   embps_error_t *err);

/** WITHDRAW into *w. */
embps_status_t embps__parse_withdraw(const uint8_t *p, size_t len, embps__withdraw_t *w,
                                     embps_error_t *err);

/** RELAY: its rank, and the frame it carries: that frame's type, payload (pointing into p) and
 * its whole bytes (header included, *frame pointing into p, *frame_len long), which is what a
 * relay forwards. Malformed: too short for a rank and a header, a carried frame whose header is
 * malformed or whose length is not the rest of the payload, or one of type RELAY. */
embps_status_t embps__parse_relay(const uint8_t *p, size_t len, uint32_t *rank, uint8_t *type,
                                  const uint8_t **payload, size_t *payload_len,
                                  const uint8_t **frame, size_t *frame_len, embps_error_t *err);

/** DEVICE into *c. */
embps_status_t embps__parse_device(const uint8_t *p, size_t len, embps__device_claim_t *c,
                                   embps_error_t *err);

/** NCCL_ID into id (EMBPS__NCCL_ID_BYTES bytes). */
embps_status_t embps__parse_nccl_id(const uint8_t *p, size_t len, uint8_t *id, embps_error_t *err);

#endif
