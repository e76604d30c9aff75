/* gRPC and protobuf framing for the client, free of I/O: byte buffers in, byte buffers out.
 * Internal to libembps (embps__ prefix). */
#ifndef EMBPS_CLIENT_WIRE_H
#define EMBPS_CLIENT_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "common/varint.h"

/* ---- protobuf encoding ---- */

/** The fields of a LookupRequest or PushGradientsRequest (which share their first fields; the
 * numbers are common/wire_fields.h's). */
typedef struct embps__batch_fields {
  const char *table;
  uint64_t batch_id;
  uint32_t shard_index;
  uint32_t shard_count;
  uint32_t tokens_per_batch;
  uint64_t tokens_bytes; /* length of the tokens field */
  int dtype;             /* 0: omitted */
  int is_push;           /* 1: PushGradientsRequest, with gradients and mode */
  uint64_t grads_bytes;  /* length of the gradients field */
  int mode;
  uint64_t client_id; /* 0: omitted */
  uint64_t digest;    /* the whole batch's (common/digest.h), the same on every shard; 0: omitted */
  uint32_t attempt;   /* 0 for the first try of the batch, one more for each retry */
} embps__batch_fields_t;

/** The encoded request around its two bulk fields: the message is
 * head | tokens | mid | gradients | tail (a lookup has no gradients), and head starts with the
 * 5-byte gRPC prefix. */
typedef struct embps__batch_frame {
  uint8_t head[5 + 5 * 11 + 2 * EMBPS_VARINT_MAX + 1024];
  size_t head_len;
  uint8_t mid[32];
  size_t mid_len;
  uint8_t tail[48]; /* mode, client_id, digest, attempt: at most 2 + 11 + 9 + 6 bytes */
  size_t tail_len;
  uint64_t total; /* bytes of the whole gRPC frame, prefix included */
} embps__batch_frame_t;

/** Encodes f's small fields. INVALID_ARGUMENT if the table name is over 1000 bytes or the
 * message would exceed gRPC's 4 GiB frame length. */
embps_status_t embps__batch_frame_build(embps__batch_frame_t *out, const embps__batch_fields_t *f,
                                        embps_error_t *err);

/** Writes the 5-byte gRPC message prefix (uncompressed, big-endian length). */
void embps__grpc_prefix(uint8_t out[5], uint32_t len);

/* ---- gRPC metadata ---- */

/** Percent-decodes src[0..len) into dst (room for len + 1 bytes, NUL-terminated), as gRPC
 * encodes grpc-message. A '%' not followed by two hex digits is copied as is. Returns the
 * decoded length. */
size_t embps__percent_decode(char *dst, const char *src, size_t len);

/** Formats a grpc-timeout value for ms milliseconds (at most 8 digits and a unit, rounding up
 * to the next unit when needed) into out; returns the length. */
size_t embps__grpc_timeout(char out[16], int64_t ms);

/** The gRPC status for an HTTP status without grpc-status (gRPC's http-grpc-status-mapping). */
embps_status_t embps__http_to_status(int http_status);

/* ---- gRPC deframing ---- */

/** Consumes a stream of gRPC frames holding exactly one message, handing its body bytes to a
 * sink as they arrive. */
typedef struct embps__deframer {
  uint8_t prefix[5];
  uint32_t prefix_have;
  uint64_t msg_len;
  uint64_t msg_have;
  int nmsgs;
} embps__deframer_t;

/** The sink of body bytes; returns EMBPS_OK or an error that stops deframing. */
typedef embps_status_t (*embps__body_sink)(void *arg, const uint8_t *p, size_t n,
                                           embps_error_t *err);

void embps__deframer_init(embps__deframer_t *d);
/** Feeds n bytes of DATA. INTERNAL on a compressed message or a second message. */
embps_status_t embps__deframer_feed(embps__deframer_t *d, const uint8_t *p, size_t n,
                                    embps__body_sink sink, void *arg, embps_error_t *err);
/** How many of the next DATA bytes are message body (0 while a prefix is due). */
uint64_t embps__deframer_body_left(const embps__deframer_t *d);
/** At end of stream: INTERNAL if no message or a truncated one arrived. */
embps_status_t embps__deframer_finish(const embps__deframer_t *d, embps_error_t *err);

/* ---- LookupResponse, parsed as it streams ---- */

/** A streaming parser of one LookupResponse body: small fields are kept, and the rows field
 * is copied straight into the caller's buffer. Fields may come in any order and repeat (last
 * one wins, as protobuf says); unknown fields are skipped. */
typedef struct embps__lookup_parser {
  /* set by the caller */
  uint8_t *dst;        /* where rows go */
  size_t dst_cap;      /* bytes of rows that are kept; rows past it (padding) are dropped */
  uint64_t rows_bytes; /* the exact length the rows field must have */
  uint64_t row_bytes;  /* the caller's bytes per row (for messages and the width check) */
  /* parsed */
  uint64_t batch_id;
  uint32_t shard_index;
  uint32_t emb_width;
  int dtype;
  int seen_rows;
  /* state */
  int state;
  int field;
  int wire_type;
  uint64_t varint;
  int varint_shift;
  uint64_t left; /* bytes left of a length-delimited or fixed field */
  uint64_t rows_have;
  int size_error;
  uint64_t bad_rows_len;
} embps__lookup_parser_t;

/** Starts a parser writing up to dst_cap bytes of rows at dst; the rows field must hold
 * rows_bytes bytes (tokens of the shard x row_bytes, the caller's bytes per row). */
void embps__lookup_parser_init(embps__lookup_parser_t *p, void *dst, size_t dst_cap,
                               uint64_t rows_bytes, uint64_t row_bytes);
/** Feeds body bytes. INTERNAL on malformed protobuf. A rows field of the wrong length is
 * skipped (nothing copied) and reported by embps__lookup_parser_finish(). */
embps_status_t embps__lookup_parser_feed(embps__lookup_parser_t *p, const uint8_t *data, size_t n,
                                         embps_error_t *err);
/** A body sink (embps__body_sink) feeding the parser given as arg. */
embps_status_t embps__lookup_parser_sink(void *arg, const uint8_t *data, size_t n,
                                         embps_error_t *err);
/** Where the parser would copy the next body bytes, when they are row bytes: returns dst at
 * the next row byte and sets *n to how many of the next body bytes go there contiguously
 * (the rest of the rows field that fits in dst_cap); NULL when the next byte is anything else.
 * A transport may read those bytes straight there and feed them from there: the parser then
 * sees data already in place and copies nothing. */
uint8_t *embps__lookup_parser_direct(const embps__lookup_parser_t *p, size_t *n);
/** At the end of the body: INTERNAL if a field is cut short; INVALID_ARGUMENT if the rows
 * are missing or their size disagrees with rows_bytes or emb_width x dtype disagrees with
 * row_bytes (the caller's output buffer does not fit the table). */
embps_status_t embps__lookup_parser_finish(const embps__lookup_parser_t *p, embps_error_t *err);

#endif
