/* Fuzz target: the checkpoint files a restore reads: a MANIFEST through the codec's decoder
 * (server/store/ckpt_codec.c, reached directly through the store's private ckpt_internal.h), and
 * a slice file restored through embps_ckpt_read_columns, the way a starting server reads them.
 *
 * The first byte picks what the rest is: bit 0 a manifest (0) or a slice file (1) of table
 * (bit 1) of fuzz_ckpt_tables.h; bit 2 whether the target first rewrites every length and
 * checksum the format carries to match the bytes (so mutations reach the fields behind the
 * crc32s) or leaves them as they are (so the checks themselves are fuzzed). A slice is written
 * to a file in a temporary checkpoint directory and restored into arrays of exactly the
 * table's size, so a row scattered outside them trips AddressSanitizer. Checked: a manifest
 * that parses is self-consistent, every refusal is one of the documented statuses with a
 * message, and nothing leaks. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/byteorder.h"
#include "common/dtype.h"
#include "server/store/checkpoint.h"
#include "server/store/ckpt_internal.h"

#include "tests/fuzz/fuzz_ckpt_tables.h"

static char dir[64];

static void remove_dir(void) {
  char path[EMBPS_CKPT_PATH_MAX], file[EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40],
      name[EMBPS_TABLE_NAME_MAX + 32];
  embps_table_config_t c;
  embps_ckpt_path(path, sizeof(path), dir, FUZZ_CKPT_ROUND);
  for (int t = 0; t < FUZZ_CKPT_TABLES; t++) {
    fuzz_ckpt_table(t, &c);
    embps_ckpt_slice_name(name, sizeof(name), 0, c.name);
    snprintf(file, sizeof(file), "%s/%s", path, name);
    unlink(file);
  }
  rmdir(path);
  rmdir(dir);
}

static void make_dir(void) {
  char path[EMBPS_CKPT_PATH_MAX];
  snprintf(dir, sizeof(dir), "/tmp/embps-fuzz-ckpt-XXXXXX");
  if (!mkdtemp(dir))
    abort();
  embps_ckpt_path(path, sizeof(path), dir, FUZZ_CKPT_ROUND);
  if (mkdir(path, 0700) != 0)
    abort();
  atexit(remove_dir);
}

static void put_crc_at(uint8_t *p, size_t off, size_t len) {
  embps_put_le32(p + off + len, embps__ckpt_crc(0, p + off, len));
}

/* Rewrites a manifest's body length and checksum to match its bytes. */
static void fix_manifest(uint8_t *p, size_t len) {
  if (len < 20)
    return;
  embps_put_le32(p + 12, (uint32_t)(len - 20));
  put_crc_at(p, 0, len - 4);
}

/* Rewrites a slice file's header, block and trailer checksums (and the header length when it is
 * out of range) to match its bytes, as far as its framing can be followed. */
static void fix_slice(uint8_t *p, size_t len) {
  uint32_t hlen, blocks_crc = 0;
  size_t off;
  if (len < 20)
    return;
  hlen = embps_get_le32(p + 12);
  if (hlen < 20 || hlen > EMBPS__CKPT_HEADER_MAX || hlen > len)
    return;
  put_crc_at(p, 0, hlen - 4);
  for (off = hlen; len - off > EMBPS__CKPT_TRAILER_BYTES &&
                   len - off - EMBPS__CKPT_TRAILER_BYTES >= EMBPS__CKPT_BLOCK_HEADER;) {
    uint32_t plen = embps_get_le32(p + off + 12);
    if (plen > len - off - EMBPS__CKPT_BLOCK_HEADER - EMBPS__CKPT_TRAILER_BYTES)
      break;
    uint32_t c =
        embps__ckpt_crc(embps__ckpt_crc(0, p + off, 16), p + off + EMBPS__CKPT_BLOCK_HEADER, plen);
    embps_put_le32(p + off + 16, c);
    blocks_crc = embps__ckpt_blocks_crc_add(blocks_crc, c);
    off += EMBPS__CKPT_BLOCK_HEADER + plen;
  }
  if (len - off == EMBPS__CKPT_TRAILER_BYTES) {
    embps_put_le32(p + off + 24, blocks_crc);
    put_crc_at(p, off, 28);
  }
}

static void check_status(embps_status_t st, const embps_error_t *err) {
  if (st != EMBPS_OK && st != EMBPS_DATA_LOSS && st != EMBPS_FAILED_PRECONDITION &&
      st != EMBPS_RESOURCE_EXHAUSTED)
    abort(); /* not a status the header documents for bad files */
  if (st != EMBPS_OK && !err->message[0])
    abort();
}

static void fuzz_manifest(uint8_t *p, size_t len) {
  embps_ckpt_manifest_t m;
  embps_error_t err;
  embps_status_t st;
  memset(&m, 0, sizeof(m));
  st = embps__ckpt_manifest_decode("fuzz/MANIFEST", p, len, &m, &err);
  check_status(st, &err);
  if (st == EMBPS_OK) {
    if (!m.group_size || (m.num_tables && !m.tables) || (m.num_files && !m.files))
      abort();
    for (size_t i = 0; i < m.num_tables; i++)
      if (strnlen(m.tables[i].name, sizeof(m.tables[i].name)) == sizeof(m.tables[i].name))
        abort();
    for (size_t i = 0; i < m.num_files; i++)
      if (strnlen(m.files[i].table, sizeof(m.files[i].table)) == sizeof(m.files[i].table))
        abort();
  }
  embps_ckpt_manifest_free(&m);
}

static void fuzz_slice(int which, const uint8_t *p, size_t len) {
  char path[EMBPS_CKPT_PATH_MAX], file[EMBPS_CKPT_PATH_MAX + EMBPS_TABLE_NAME_MAX + 40],
      name[EMBPS_TABLE_NAME_MAX + 32];
  embps_table_config_t c;
  embps_ckpt_file_t f;
  embps_ckpt_manifest_t m;
  embps_ckpt_dest_t d;
  embps_error_t err;
  int fd;

  fuzz_ckpt_table(which, &c);
  embps_ckpt_path(path, sizeof(path), dir, FUZZ_CKPT_ROUND);
  embps_ckpt_slice_name(name, sizeof(name), 0, c.name);
  snprintf(file, sizeof(file), "%s/%s", path, name);
  if ((fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600)) < 0)
    abort();
  if (embps__ckpt_write_all(fd, p, len) != 0)
    abort();
  close(fd);

  memset(&f, 0, sizeof(f));
  snprintf(f.table, sizeof(f.table), "%s", c.name);
  f.bytes = len;
  memset(&m, 0, sizeof(m));
  m.format_version = EMBPS_CKPT_FORMAT_VERSION;
  m.round = FUZZ_CKPT_ROUND;
  m.group_size = 1;
  m.num_tables = 1;
  m.tables = &c;
  m.num_files = 1;
  m.files = &f;

  size_t n = (size_t)c.rows * c.emb_width;
  const embps_optimizer_info_t *oi = embps_optimizer_info(c.optimizer);
  memset(&d, 0, sizeof(d));
  d.shard_width = c.emb_width;
  d.data = malloc(n * embps_dtype_size(c.dtype));
  if (oi->state_per_element >= 1)
    d.state0 = malloc(n * sizeof(float));
  else if (oi->state_per_row)
    d.state0 = malloc((size_t)c.rows * sizeof(float));
  if (oi->state_per_element >= 2)
    d.state1 = malloc(n * sizeof(float));
  check_status(embps_ckpt_read_columns(dir, &m, c.name, &d, &err), &err);
  free(d.data);
  free(d.state0);
  free(d.state1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  if (!dir[0])
    make_dir();
  uint8_t *p = malloc(size); /* exactly the file's bytes */
  memcpy(p, data + 1, size - 1);
  if (data[0] & 1) {
    if (data[0] & 4)
      fix_slice(p, size - 1);
    fuzz_slice((data[0] >> 1) & 1, p, size - 1);
  } else {
    if (data[0] & 4)
      fix_manifest(p, size - 1);
    fuzz_manifest(p, size - 1);
  }
  free(p);
  return 0;
}
