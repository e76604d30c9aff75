/* Fuzz target: the shard group's bootstrap hello and control-plane frames
 * (server/group/control.c), and the acceptor's judgement of a hello (agreement.c), i.e. all
 * that a rank reads from its peer port.
 *
 * The first byte picks what the rest is:
 *   0  a hello as an acceptor reads it: the magic checked on every prefix, the header decoded,
 *      then the identity that follows judged by rank 0 of a group of 4 (and compared with
 *      this rank's identity both ways);
 *   1  a verdict as a connector reads it;
 *   2+ a control connection's byte stream: frames split off one by one and each payload
 *      parsed by its type.
 * Every frame that parses is encoded again, parsed again and encoded once more: the two
 * encodings must be equal (what the decoder accepts, the encoder writes back the same). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/alloc.h"
#include "server/group/agreement.h"
#include "server/group/control.h"

#define HERE_IDENTITY "version=0.1.0\nmesh=shard=4\ntable_axis=shard\ndata_axis=shard\n"

static void fuzz_hello(const uint8_t *p, size_t n) {
  embps__hello_t h;
  embps_error_t err;
  char why[512];
  const int control_fds[4] = {-1, -1, 7, -1}, data_fds[4] = {-1, 8, -1, -1};

  for (size_t k = 0; k <= n && k <= EMBPS__HELLO_MAGIC_LEN; k++)
    (void)embps__hello_magic_ok(p, k);
  if (n < EMBPS__HELLO_HEADER_LEN || embps__hello_decode(p, &h, &err) != EMBPS_OK)
    return;
  if (h.identity_len >= EMBPS__MAX_IDENTITY_LEN)
    abort(); /* decode promised to refuse it */
  size_t have = n - EMBPS__HELLO_HEADER_LEN;
  size_t len = h.identity_len < have ? h.identity_len : have;
  char *identity = embps_malloc(len + 1);
  if (!identity)
    return;
  memcpy(identity, p + EMBPS__HELLO_HEADER_LEN, len);
  identity[len] = '\0';
  if (embps__judge_hello(0, 4, HERE_IDENTITY, &h, identity, "127.0.0.1:1", control_fds, data_fds,
                         why, sizeof(why)) == 0) {
    /* Accepted: only a higher rank of this group, on a kind it has not connected yet. */
    if (h.size != 4 || h.rank == 0 || h.rank >= 4 || h.kind > 1 ||
        (h.kind == 0 ? control_fds : data_fds)[h.rank] != -1)
      abort();
  } else if (strnlen(why, sizeof(why)) == sizeof(why) || !why[0]) {
    abort(); /* a refusal says why, in a terminated string */
  }
  (void)embps__identity_differs(identity, 1, HERE_IDENTITY, 0, why, sizeof(why));
  (void)embps__identity_differs(HERE_IDENTITY, 0, identity, h.rank, why, 40);
  embps_free(identity);
}

static void fuzz_verdict(const uint8_t *p, size_t n) {
  int accept;
  size_t message_len;
  embps_error_t err;
  if (n < EMBPS__VERDICT_HEADER_LEN ||
      embps__verdict_decode(p, &accept, &message_len, &err) != EMBPS_OK)
    return;
  if (message_len > 0xffff)
    abort();
}

/* One decoded frame, of any type. */
typedef struct decoded {
  embps_batch_desc_t notice;
  embps_round_entry_t entries[EMBPS__ROUND_MAX];
  embps_table_config_t configs[EMBPS__ROUND_MAX];
  embps__ckpt_order_t ckpts[EMBPS__ROUND_MAX];
  size_t n;
  char why[EMBPS__BROKEN_MAX + 1];
  embps__device_claim_t claim;
  uint8_t nccl_id[EMBPS__NCCL_ID_BYTES];
  embps__ckpt_msg_t ckpt;
  embps__withdraw_t withdraw;
  uint32_t relay_rank; /* RELAY: its rank and the frame it carries (pointing into the input) */
  const uint8_t *relay_frame;
  size_t relay_frame_len;
} decoded_t;

static embps_status_t parse(uint8_t type, const uint8_t *p, size_t len, decoded_t *d);

/* RELAY: the carried frame must itself parse (it is never a RELAY: depth 1). */
static embps_status_t parse_relay(const uint8_t *p, size_t len, decoded_t *d, embps_error_t *err) {
  static decoded_t inner;
  const uint8_t *payload;
  size_t payload_len;
  uint8_t type;
  embps_status_t st = embps__parse_relay(p, len, &d->relay_rank, &type, &payload, &payload_len,
                                         &d->relay_frame, &d->relay_frame_len, err);
  if (st != EMBPS_OK)
    return st;
  if (type == EMBPS__FRAME_RELAY || d->relay_frame_len != payload_len + EMBPS__FRAME_HEADER_LEN)
    abort();
  memset(&inner, 0, sizeof(inner));
  st = parse(type, payload, payload_len, &inner);
  if (st != EMBPS_OK)
    embps_error_set(err, st, "malformed carried frame");
  return st;
}

static embps_status_t parse(uint8_t type, const uint8_t *p, size_t len, decoded_t *d) {
  embps_error_t err;
  embps_status_t st;
  switch (type) {
  case EMBPS__FRAME_NOTICE:
    st = embps__parse_notice(p, len, &d->notice, &err);
    break;
  case EMBPS__FRAME_ROUND:
    st =
        embps__parse_round(p, len, d->entries, d->configs, d->ckpts, EMBPS__ROUND_MAX, &d->n, &err);
    break;
  case EMBPS__FRAME_BROKEN:
  case EMBPS__FRAME_LEAVING: /* the same payload: a sentence */
    st = embps__parse_broken(p, len, d->why, sizeof(d->why), &err);
    break;
  case EMBPS__FRAME_DEVICE:
    st = embps__parse_device(p, len, &d->claim, &err);
    break;
  case EMBPS__FRAME_NCCL_ID:
    st = embps__parse_nccl_id(p, len, d->nccl_id, &err);
    break;
  case EMBPS__FRAME_CHECKPOINT:
    st = embps__parse_checkpoint(p, len, &d->ckpt, &err);
    break;
  case EMBPS__FRAME_WITHDRAW:
    st = embps__parse_withdraw(p, len, &d->withdraw, &err);
    break;
  case EMBPS__FRAME_RELAY:
    st = parse_relay(p, len, d, &err);
    break;
  default:
    abort(); /* embps__frame_next passed a type it does not know */
  }
  if (st != EMBPS_OK && (st != EMBPS_INVALID_ARGUMENT || !err.message[0]))
    abort(); /* malformed input is INVALID_ARGUMENT, with a message */
  return st;
}

static embps_status_t encode(uint8_t type, const decoded_t *d, embps__buf_t *b) {
  embps_error_t err;
  switch (type) {
  case EMBPS__FRAME_NOTICE:
    return embps__frame_notice(b, &d->notice, &err);
  case EMBPS__FRAME_ROUND:
    return embps__frame_round(b, d->entries, d->configs, d->ckpts, d->n, &err);
  case EMBPS__FRAME_BROKEN:
    return embps__frame_broken(b, d->why, &err);
  case EMBPS__FRAME_LEAVING:
    return embps__frame_leaving(b, d->why, &err);
  case EMBPS__FRAME_DEVICE:
    return embps__frame_device(b, &d->claim, &err);
  case EMBPS__FRAME_NCCL_ID:
    return embps__frame_nccl_id(b, d->nccl_id, &err);
  case EMBPS__FRAME_WITHDRAW:
    return embps__frame_withdraw(b, &d->withdraw, &err);
  case EMBPS__FRAME_RELAY:
    return embps__frame_relay(b, d->relay_rank, d->relay_frame, d->relay_frame_len, &err);
  default:
    return embps__frame_checkpoint(b, &d->ckpt, &err);
  }
}

/* encode(parse(frame)) == encode(parse(encode(parse(frame)))). */
static void check_round_trip(uint8_t type, const decoded_t *first) {
  static decoded_t again;
  embps__buf_t b1 = {0}, b2 = {0};
  uint8_t t;
  const uint8_t *payload;
  size_t payload_len, frame_len;
  embps_error_t err;

  if (encode(type, first, &b1) != EMBPS_OK)
    goto exit; /* a field the format cannot carry (say, a name the encoder refuses) */
  if (embps__frame_next(b1.data, b1.len, &t, &payload, &payload_len, &frame_len, &err) !=
          EMBPS_OK ||
      frame_len != b1.len || t != type)
    abort(); /* the encoder wrote a frame that does not split */
  memset(&again, 0, sizeof(again));
  if (parse(type, payload, payload_len, &again) != EMBPS_OK ||
      encode(type, &again, &b2) != EMBPS_OK)
    abort(); /* the decoder refused what the encoder wrote */
  if (b1.len != b2.len || memcmp(b1.data, b2.data, b1.len) != 0)
    abort();
exit:
  embps__buf_free(&b1);
  embps__buf_free(&b2);
}

static void fuzz_frames(const uint8_t *p, size_t n) {
  static decoded_t d;
  for (int frames = 0; frames < 64; frames++) {
    uint8_t type;
    const uint8_t *payload;
    size_t payload_len, frame_len;
    embps_error_t err;
    if (embps__frame_next(p, n, &type, &payload, &payload_len, &frame_len, &err) != EMBPS_OK ||
        frame_len == 0)
      return;
    if (frame_len > n || payload_len != frame_len - EMBPS__FRAME_HEADER_LEN)
      abort();
    memset(&d, 0, sizeof(d));
    if (parse(type, payload, payload_len, &d) == EMBPS_OK)
      check_round_trip(type, &d);
    p += frame_len;
    n -= frame_len;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  if (data[0] == 0)
    fuzz_hello(data + 1, size - 1);
  else if (data[0] == 1)
    fuzz_verdict(data + 1, size - 1);
  else
    fuzz_frames(data + 1, size - 1);
  return 0;
}
