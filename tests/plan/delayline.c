/* delayline: a fixed one-way delay for every packet routed through a TUN device, in user space,
 * for the checked predictions of `embps plan` across links with delay (issue 34,
 * tests/plan/test_plan_delay.py, docs/capacity.md). This kernel has no sch_netem, so tc cannot
 * delay packets; the test routes every packet between its namespaces through the tun this
 * program opens instead, and tc's tbf still shapes the rate on the veths.
 *
 * It opens (creates) the tun NAME (IFF_TUN | IFF_NO_PI: each read or write is one bare IP
 * packet), prints "ready NAME" on stdout, and then reads every packet the kernel routes into the
 * tun, holds it for --delay-ms, and writes it back into the same tun when it is due; the kernel
 * then routes it on (the test's policy routing sends packets that come out of the tun by the
 * main table). The delay is the same for every packet, so a FIFO keeps both the order and the
 * due times: a ring of bytes holds each packet behind a record of its due time on
 * CLOCK_MONOTONIC and its length. ppoll sleeps until the head's due time (timer slack 1 ns), all
 * packets due are written at once, and up to BATCH packets are read per wake-up. It runs at a
 * real-time priority (SCHED_FIFO) where it may: on a loaded machine a normal priority's wake-ups
 * come milliseconds late (4 ms on average on this project's shared 2 cores, 13 µs with it).
 *
 * Memory is bounded by --ring-mbytes: a packet that finds the ring full is read and dropped
 * (counted). The link it models is not the bottleneck: the test shapes the rate after it.
 *
 * It exits on SIGTERM or SIGINT, when its parent dies (PR_SET_PDEATHSIG), and at end of file on
 * stdin when stdin is a pipe (the test holds the pipe's other end), printing its counters on
 * stdout: packets and bytes in, out, dropped, write errors, the most held at once, how often the
 * ring wrapped around, and how late (after its due time) packets went out.
 *
 *   delayline --tun NAME --delay-ms MS [--ring-mbytes MB]
 *
 * Needs CAP_NET_ADMIN (root); exit status 0 after a signal or EOF, 2 on a usage error, 1 when
 * the tun cannot be opened or read. */
#include <errno.h>
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { MAX_PACKET = 65536, BATCH = 64 };

/* The record before each packet in the ring; wrap != 0 marks the rest of the ring unused (the
 * next record is at offset 0). */
typedef struct rec {
  int64_t due_ns;
  uint32_t len;
  uint32_t wrap;
} rec_t;

/* A FIFO of packets in one buffer of cap bytes: records from head to tail, in order. */
typedef struct ring {
  uint8_t *buf;
  size_t cap, head, tail, count, bytes;
} ring_t;

typedef struct counters {
  uint64_t in, in_bytes, out, out_bytes, dropped, write_errors, most_held, most_bytes, wraps;
  double late_sum_ns, late_max_ns;
} counters_t;

static volatile sig_atomic_t stop;

static void on_signal(int sig) { stop = sig; }

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static size_t round8(size_t n) { return (n + 7u) & ~(size_t)7u; }

/* Where a packet of up to MAX_PACKET bytes would go: its record's offset, and *wrap set when the
 * record goes to offset 0 and the ring's tail must be marked; (size_t)-1 when the ring is full. */
static size_t ring_reserve(ring_t *r, int *wrap) {
  const size_t need = sizeof(rec_t) + MAX_PACKET;
  *wrap = 0;
  if (r->count == 0)
    r->head = r->tail = 0;
  if (r->count > 0 && r->tail == r->head)
    return (size_t)-1;
  if (r->tail >= r->head) {
    if (r->cap - r->tail >= need)
      return r->tail;
    if (need <= r->head) {
      *wrap = 1;
      return 0;
    }
    return (size_t)-1;
  }
  return r->head - r->tail >= need ? r->tail : (size_t)-1;
}

/* Appends the packet of len bytes read at the offset ring_reserve gave. */
static void ring_commit(ring_t *r, size_t at, int wrap, uint32_t len, int64_t due_ns) {
  rec_t rec = {.due_ns = due_ns, .len = len, .wrap = 0};
  if (wrap && r->cap - r->tail >= sizeof(rec_t)) {
    rec_t mark = {.due_ns = 0, .len = 0, .wrap = 1};
    memcpy(r->buf + r->tail, &mark, sizeof mark);
  }
  memcpy(r->buf + at, &rec, sizeof rec);
  r->tail = at + sizeof(rec_t) + round8(len);
  if (r->tail == r->cap)
    r->tail = 0;
  r->count++;
  r->bytes += len;
}

/* The oldest packet's record (its data follows it), or NULL when the ring is empty. */
static rec_t *ring_head(ring_t *r) {
  rec_t *rec;
  if (r->count == 0)
    return NULL;
  if (r->cap - r->head < sizeof(rec_t) || ((rec_t *)(void *)(r->buf + r->head))->wrap)
    r->head = 0;
  rec = (rec_t *)(void *)(r->buf + r->head);
  return rec;
}

static void ring_pop(ring_t *r) {
  rec_t *rec = ring_head(r);
  r->bytes -= rec->len;
  r->head += sizeof(rec_t) + round8(rec->len);
  if (r->head == r->cap)
    r->head = 0;
  if (--r->count == 0)
    r->head = r->tail = 0;
}

static int open_tun(const char *name) {
  struct ifreq ifr;
  int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    fprintf(stderr, "delayline: cannot open /dev/net/tun: %s\n", strerror(errno));
    return -1;
  }
  memset(&ifr, 0, sizeof ifr);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  snprintf(ifr.ifr_name, sizeof ifr.ifr_name, "%s", name);
  if (ioctl(fd, TUNSETIFF, &ifr) != 0) {
    fprintf(stderr, "delayline: cannot create the tun %s (TUNSETIFF): %s\n", name, strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* Writes every packet due by now into the tun, in order. */
static void flush_due(int fd, ring_t *r, counters_t *c) {
  int64_t now = now_ns();
  rec_t *rec;
  while ((rec = ring_head(r))) {
    double late;
    if (rec->due_ns > now && (now = now_ns()) < rec->due_ns)
      break; /* looked again: the next one may have come due while these were written */
    late = (double)(now - rec->due_ns);
    if (write(fd, rec + 1, rec->len) == (ssize_t)rec->len) {
      c->out++;
      c->out_bytes += rec->len;
      c->late_sum_ns += late;
      if (late > c->late_max_ns)
        c->late_max_ns = late;
    } else
      c->write_errors++;
    ring_pop(r);
  }
}

/* Reads up to BATCH packets; 0, or -1 when the tun failed. */
static int read_packets(int fd, ring_t *r, uint8_t *scratch, int64_t delay_ns, counters_t *c) {
  for (int i = 0; i < BATCH; i++) {
    int wrap;
    size_t at = ring_reserve(r, &wrap);
    uint8_t *dst = at == (size_t)-1 ? scratch : r->buf + at + sizeof(rec_t);
    ssize_t n = read(fd, dst, MAX_PACKET);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR)
        return 0;
      fprintf(stderr, "delayline: read from the tun: %s\n", strerror(errno));
      return -1;
    }
    c->in++;
    c->in_bytes += (uint64_t)n;
    if (at == (size_t)-1) {
      c->dropped++;
      continue;
    }
    ring_commit(r, at, wrap, (uint32_t)n, now_ns() + delay_ns);
    c->wraps += (uint64_t)wrap;
    if (r->count > c->most_held)
      c->most_held = r->count;
    if (r->bytes > c->most_bytes)
      c->most_bytes = r->bytes;
  }
  return 0;
}

static int usage(const char *why) {
  fprintf(stderr,
          "delayline: %s\nusage: delayline --tun NAME --delay-ms MS [--ring-mbytes MB] (MS from 0 "
          "to 10000, MB from 1 to 1024, default 16)\n",
          why);
  return 2;
}

int main(int argc, char **argv) {
  const char *name = NULL;
  double delay_ms = -1, ring_mb = 16;
  struct pollfd fds[2];
  struct stat st;
  struct sigaction sa;
  sigset_t block, waitmask;
  counters_t c;
  ring_t r;
  uint8_t *scratch;
  int64_t delay_ns;
  int fd, nfds = 1, rc = 0, realtime;

  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    if (i + 1 >= argc)
      return usage("every flag takes a value: give it after the flag");
    if (!strcmp(argv[i], "--tun"))
      name = argv[++i];
    else if (!strcmp(argv[i], "--delay-ms"))
      delay_ms = strtod(argv[++i], &end);
    else if (!strcmp(argv[i], "--ring-mbytes"))
      ring_mb = strtod(argv[++i], &end);
    else
      return usage("unknown flag: the flags are --tun, --delay-ms and --ring-mbytes");
    if (end && *end)
      return usage("--delay-ms and --ring-mbytes take a number (ms, MB)");
  }
  if (!name || strlen(name) >= IFNAMSIZ)
    return usage("--tun NAME is required: the tun device to create, at most 15 characters");
  if (!(delay_ms >= 0 && delay_ms <= 10000))
    return usage("--delay-ms must be a one-way delay from 0 to 10000 ms");
  if (!(ring_mb >= 1 && ring_mb <= 1024))
    return usage("--ring-mbytes must be the ring's size from 1 to 1024 MB");
  delay_ns = (int64_t)(delay_ms * 1e6 + 0.5);

  /* Exit with the parent, and leave the signals that stop us blocked but for the sleep. */
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  prctl(PR_SET_TIMERSLACK, 1UL);
  /* A packet waits for this process to wake: on a loaded machine a normal priority's wake-ups
   * come milliseconds late, so it takes a real-time priority where it may (root may). */
  {
    struct sched_param sp = {.sched_priority = 10};
    realtime = sched_setscheduler(0, SCHED_FIFO, &sp) == 0;
  }
  if (getppid() == 1)
    return 0;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  sigaddset(&block, SIGINT);
  sigprocmask(SIG_BLOCK, &block, &waitmask);
  sigdelset(&waitmask, SIGTERM);
  sigdelset(&waitmask, SIGINT);

  memset(&c, 0, sizeof c);
  memset(&r, 0, sizeof r);
  r.cap = round8((size_t)(ring_mb * 1024 * 1024));
  r.buf = malloc(r.cap);
  scratch = malloc(MAX_PACKET);
  if (!r.buf || !scratch) {
    fprintf(stderr, "delayline: out of memory for a ring of %zu bytes\n", r.cap);
    return 1;
  }
  if ((fd = open_tun(name)) < 0)
    return 1;
  fds[0] = (struct pollfd){.fd = fd, .events = POLLIN};
  if (fstat(0, &st) == 0 && S_ISFIFO(st.st_mode)) {
    fds[1] = (struct pollfd){.fd = 0, .events = POLLIN};
    nfds = 2;
  }
  printf("ready %s\n", name);
  fflush(stdout);

  while (!stop) {
    struct timespec ts, *tp = NULL;
    rec_t *head;
    flush_due(fd, &r, &c);
    if ((head = ring_head(&r))) {
      int64_t wait = head->due_ns - now_ns();
      if (wait < 0)
        wait = 0;
      ts.tv_sec = (time_t)(wait / 1000000000);
      ts.tv_nsec = (long)(wait % 1000000000);
      tp = &ts;
    }
    if (ppoll(fds, (nfds_t)nfds, tp, &waitmask) < 0) {
      if (errno == EINTR)
        continue;
      fprintf(stderr, "delayline: poll: %s\n", strerror(errno));
      rc = 1;
      break;
    }
    if (nfds == 2 && fds[1].revents) {
      char b[256];
      if (read(0, b, sizeof b) <= 0)
        break; /* the parent closed its end */
    }
    if (fds[0].revents & (POLLERR | POLLHUP | POLLNVAL)) {
      fprintf(stderr, "delayline: the tun %s failed\n", name);
      rc = 1;
      break;
    }
    if ((fds[0].revents & POLLIN) && read_packets(fd, &r, scratch, delay_ns, &c) != 0) {
      rc = 1;
      break;
    }
  }
  printf("delayline %s: %.3f ms%s; in %llu packets %llu bytes; out %llu packets %llu bytes; "
         "dropped %llu (ring full); write errors %llu; held at exit %zu; most held %llu packets "
         "%llu bytes; wrapped %llu; late mean %.1f us max %.1f us\n",
         name, delay_ms, realtime ? " (SCHED_FIFO)" : "", (unsigned long long)c.in,
         (unsigned long long)c.in_bytes, (unsigned long long)c.out, (unsigned long long)c.out_bytes,
         (unsigned long long)c.dropped, (unsigned long long)c.write_errors, r.count,
         (unsigned long long)c.most_held, (unsigned long long)c.most_bytes,
         (unsigned long long)c.wraps, c.out ? c.late_sum_ns / (double)c.out / 1e3 : 0.0,
         c.late_max_ns / 1e3);
  fflush(stdout);
  close(fd);
  free(r.buf);
  free(scratch);
  return rc;
}
