/* The C API from C, between two processes (tests/c_api.rs compiles and runs it):
 *
 *   two_procs target PROVIDER DIR      two_procs initiator PROVIDER DIR
 *   alloc 4 MiB, descriptor -> DIR/desc, pid -> DIR/pid
 *                                      remote region from DIR/desc
 *                                      2 MiB as 16 write_imm (imm 7), 1 MiB as a batch of
 *                                      256 writes in reverse order, 1 MiB as a paged write
 *                                      (imm 7) whose end a callback announces; waits for
 *                                      every op
 *                                      send "n=ARRIVALS"
 *   recv, wait for ARRIVALS of imm 7,
 *   check all 4 MiB, send "verified"
 *                                      recv; read all 4 MiB back (one read, then a batch of
 *                                      1024 reads), check; bad arguments -> their errors;
 *                                      SIGKILL the target, post until a write fails with
 *                                      PEER_UNREACHABLE / CONNECTION_LOST (bounded)
 *
 * Every wait is bounded; any unexpected status prints fabric_last_error() and exits 1. */
#define _DEFAULT_SOURCE
#include <fabric.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LEN (4u << 20)
#define HALF (LEN / 2)
#define IMM 7u

static const char *role = "?";

static void die(const char *what, fabric_status s) {
    fprintf(stderr, "%s: %s: %s (%s)\n", role, what, fabric_status_name(s), fabric_last_error());
    exit(1);
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        fabric_status s_ = (call);                                                                 \
        if (s_ != FABRIC_STATUS_OK) die(#call, s_);                                                \
    } while (0)

#define EXPECT(call, want)                                                                         \
    do {                                                                                           \
        fabric_status s_ = (call);                                                                 \
        if (s_ != (want)) {                                                                        \
            fprintf(stderr, "%s: %s gave %s, not %s (%s)\n", role, #call, fabric_status_name(s_),  \
                    fabric_status_name(want), fabric_last_error());                                \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static uint8_t pattern(size_t i) { return (uint8_t)(i * 131u + 7u); }

/* fabric_op_set_wake's callback: counts its calls (from the engine's reactor thread). */
static int wakes;
static void woken(void *ctx) { __atomic_add_fetch((int *)ctx, 1, __ATOMIC_ACQ_REL); }

static void put_file(const char *dir, const char *name, const void *data, size_t len) {
    char tmp[512], path[512];
    snprintf(tmp, sizeof tmp, "%s/%s.tmp", dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0 || rename(tmp, path) != 0) {
        perror("put_file");
        exit(1);
    }
}

/* The file's bytes once it exists (waits up to 20 s). */
static size_t get_file(const char *dir, const char *name, uint8_t *buf, size_t cap) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    double end = now_ms() + 20000;
    for (;;) {
        FILE *f = fopen(path, "rb");
        if (f) {
            size_t n = fread(buf, 1, cap, f);
            fclose(f);
            return n;
        }
        if (now_ms() > end) {
            fprintf(stderr, "%s: %s never appeared\n", role, path);
            exit(1);
        }
        usleep(10000);
    }
}

/* The next message, waiting up to 20 s. */
static size_t recv_msg(fabric_engine *e, uint8_t *buf, size_t cap, uint32_t *peer) {
    size_t len = 0;
    double end = now_ms() + 20000;
    for (;;) {
        fabric_status s = fabric_try_recv(e, peer, buf, cap, &len);
        if (s == FABRIC_STATUS_OK) return len;
        if (s != FABRIC_STATUS_ERR_AGAIN) die("fabric_try_recv", s);
        if (now_ms() > end) {
            fprintf(stderr, "%s: no message in 20 s\n", role);
            exit(1);
        }
        usleep(200);
    }
}

static void finish(fabric_op *op, const char *what) {
    fabric_status s = fabric_op_wait(op, 20000);
    if (s != FABRIC_STATUS_OK) die(what, s);
    fabric_op_free(op);
}

static fabric_engine *engine(const char *provider) {
    fabric_engine_options o;
    fabric_engine_options_init(&o);
    o.provider = provider;
    fabric_engine *e = NULL;
    CHECK(fabric_engine_new(&o, &e));
    return e;
}

static int target(const char *provider, const char *dir) {
    fabric_engine *e = engine(provider);
    fabric_region *r = NULL;
    CHECK(fabric_alloc(e, LEN, -1, &r));
    uint8_t desc[4096];
    size_t dlen = 0;
    CHECK(fabric_region_descriptor(r, desc, sizeof desc, &dlen));
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
    put_file(dir, "pid", pid, (size_t)n);
    put_file(dir, "desc", desc, dlen);

    size_t cap = fabric_engine_max_msg_size(e);
    uint8_t *msg = malloc(cap + 1);
    uint32_t peer = 0;
    size_t len = recv_msg(e, msg, cap, &peer);
    msg[len] = 0;
    unsigned long arrivals = 0;
    if (sscanf((char *)msg, "n=%lu", &arrivals) != 1) {
        fprintf(stderr, "target: unexpected message %s\n", (char *)msg);
        return 1;
    }
    fabric_op *wait = NULL;
    CHECK(fabric_counter_wait(e, IMM, arrivals, &wait));
    finish(wait, "counter wait");
    const uint8_t *p = fabric_region_ptr(r);
    for (size_t i = 0; i < LEN; i++) {
        if (p[i] != pattern(i)) {
            fprintf(stderr, "target: byte %zu is %u, not %u\n", i, p[i], pattern(i));
            return 1;
        }
    }
    printf("target: %lu arrivals of imm %u, %u bytes checked\n", arrivals, IMM, LEN);
    fflush(stdout);
    fabric_op *op = NULL;
    CHECK(fabric_send(e, peer, (const uint8_t *)"verified", 8, &op));
    finish(op, "send");
    /* Stay up for the reads, until the initiator kills this process (bounded). */
    sleep(30);
    fprintf(stderr, "target: never killed\n");
    return 1;
}

static int initiator(const char *provider, const char *dir) {
    fabric_engine *e = engine(provider);
    uint8_t desc[4096];
    size_t dlen = get_file(dir, "desc", desc, sizeof desc);
    fabric_remote *dst = NULL;
    CHECK(fabric_remote_new(e, desc, dlen, &dst));
    if (fabric_remote_len(dst) != LEN) {
        fprintf(stderr, "initiator: remote region of %llu bytes\n", (unsigned long long)fabric_remote_len(dst));
        return 1;
    }
    uint32_t peer = fabric_remote_peer(dst);

    /* Memory of our own, registered in place. */
    uint8_t *src_mem = aligned_alloc(4096, LEN);
    uint8_t *back_mem = aligned_alloc(4096, LEN);
    for (size_t i = 0; i < LEN; i++) src_mem[i] = pattern(i);
    memset(back_mem, 0, LEN);
    fabric_region *src = NULL, *back = NULL;
    CHECK(fabric_register(e, src_mem, LEN, -1, &src));
    CHECK(fabric_register(e, back_mem, LEN, -1, &back));

    /* First half: 16 write_imm of 128 KiB. */
    enum { CHUNKS = 16 };
    fabric_op *ops[CHUNKS];
    uint64_t arrivals = 0;
    for (int i = 0; i < CHUNKS; i++) {
        uint64_t off = (uint64_t)i * (HALF / CHUNKS), a = 0;
        CHECK(fabric_write_imm(e, src, off, dst, off, HALF / CHUNKS, IMM, &ops[i]));
        CHECK(fabric_write_arrivals(e, dst, HALF / CHUNKS, &a));
        arrivals += a;
    }
    /* Third quarter: one batch of 256 writes of 4 KiB, in reverse order. */
    enum { PAGES = 256 };
    fabric_batch_entry *b = calloc(PAGES, sizeof *b);
    for (int i = 0; i < PAGES; i++) {
        uint64_t off = HALF + (uint64_t)(PAGES - 1 - i) * 4096;
        b[i] = (fabric_batch_entry){src, off, dst, off, 4096};
    }
    fabric_op *batch = NULL;
    CHECK(fabric_batch(e, FABRIC_BATCH_OP_WRITE, b, PAGES, &batch));
    /* Last quarter: a paged write of 256 pages of 4 KiB (page i to page i), with the
     * immediate, whose end a callback announces. */
    uint32_t pages_list[PAGES];
    for (int i = 0; i < PAGES; i++) pages_list[i] = (uint32_t)i;
    fabric_page_layout layout = {4096, 4096, 4096, HALF + HALF / 2, HALF + HALF / 2};
    fabric_op *paged = NULL;
    CHECK(fabric_write_paged(e, src, dst, &layout, pages_list, pages_list, PAGES, IMM, &paged));
    uint64_t a = 0;
    CHECK(fabric_paged_arrivals(e, dst, PAGES, &a));
    arrivals += a;
    CHECK(fabric_op_set_wake(paged, woken, (void *)&wakes));
    double end = now_ms() + 20000;
    while (fabric_op_test(paged) == FABRIC_STATUS_IN_PROGRESS || __atomic_load_n(&wakes, __ATOMIC_ACQUIRE) == 0) {
        if (now_ms() > end) {
            fprintf(stderr, "initiator: the paged write's callback never came (%d calls)\n", wakes);
            return 1;
        }
        usleep(100);
    }
    EXPECT(fabric_op_test(paged), FABRIC_STATUS_OK);
    fabric_op_free(paged);
    for (int i = 0; i < CHUNKS; i++) finish(ops[i], "write_imm");
    finish(batch, "write batch");
    char msg[64];
    int n = snprintf(msg, sizeof msg, "n=%llu", (unsigned long long)arrivals);
    fabric_op *op = NULL;
    CHECK(fabric_send(e, peer, (const uint8_t *)msg, (size_t)n, &op));
    finish(op, "send");

    size_t cap = fabric_engine_max_msg_size(e);
    uint8_t *in = malloc(cap);
    uint32_t from = 0;
    size_t len = recv_msg(e, in, cap, &from);
    if (len != 8 || memcmp(in, "verified", 8) != 0 || from != peer) {
        fprintf(stderr, "initiator: unexpected reply of %zu bytes from peer %u\n", len, from);
        return 1;
    }

    /* Reads: the first 1 MiB in one read, the rest as a batch of 768 reads of 4 KiB whose
     * destinations are scrambled (page k lands at page (k * 5) mod 768 of the rest). */
    CHECK(fabric_read(e, back, 0, dst, 0, 1u << 20, &op));
    finish(op, "read");
    enum { RPAGES = 768 };
    fabric_batch_entry *rb = calloc(RPAGES, sizeof *rb);
    for (int k = 0; k < RPAGES; k++) {
        uint64_t from_off = (1u << 20) + (uint64_t)k * 4096;
        uint64_t to_off = (1u << 20) + (uint64_t)((k * 5) % RPAGES) * 4096;
        rb[k] = (fabric_batch_entry){back, to_off, dst, from_off, 4096};
    }
    CHECK(fabric_batch(e, FABRIC_BATCH_OP_READ, rb, RPAGES, &op));
    finish(op, "read batch");
    for (size_t i = 0; i < LEN; i++) {
        size_t src_i = i;
        if (i >= (1u << 20)) {
            size_t page = (i - (1u << 20)) / 4096, in_page = (i - (1u << 20)) % 4096;
            /* page p of the rest holds remote page k with (k * 5) % 768 == p. */
            size_t k = 0;
            while ((k * 5) % RPAGES != page) k++;
            src_i = (1u << 20) + k * 4096 + in_page;
        }
        if (back_mem[i] != pattern(src_i)) {
            fprintf(stderr, "initiator: read-back byte %zu is %u, not %u\n", i, back_mem[i], pattern(src_i));
            return 1;
        }
    }
    printf("initiator: %u bytes written (write_imm, batch, paged; %d callback calls) and read back (read and batch)\n", LEN, wakes);

    /* Bad arguments: clear errors, nothing posted. */
    EXPECT(fabric_write(e, src, LEN - 8, dst, 0, 16, &op), FABRIC_STATUS_ERR_OUT_OF_BOUNDS);
    EXPECT(fabric_write(e, src, 0, dst, LEN - 8, 16, &op), FABRIC_STATUS_ERR_OUT_OF_BOUNDS);
    EXPECT(fabric_write(NULL, src, 0, dst, 0, 16, &op), FABRIC_STATUS_ERR_INVALID);
    EXPECT(fabric_write(e, src, 0, NULL, 0, 16, &op), FABRIC_STATUS_ERR_INVALID);
    EXPECT(fabric_send(e, 999, (const uint8_t *)"x", 1, &op), FABRIC_STATUS_ERR_UNKNOWN_PEER);
    fabric_remote *junk = NULL;
    EXPECT(fabric_remote_new(e, (const uint8_t *)"not a descriptor", 16, &junk), FABRIC_STATUS_ERR_MALFORMED);
    uint8_t small[4];
    EXPECT(fabric_try_recv(e, &from, small, sizeof small, &len), FABRIC_STATUS_ERR_INVALID);
    EXPECT(fabric_counter_try_consume(e, 12345, 1), FABRIC_STATUS_ERR_AGAIN);
    if (strlen(fabric_last_error()) == 0) {
        fprintf(stderr, "initiator: an error without a message\n");
        return 1;
    }
    printf("initiator: bad arguments refused\n");

    /* A dead peer: SIGKILL the target; writes must fail, never hang. */
    char pid[32] = {0};
    get_file(dir, "pid", (uint8_t *)pid, sizeof pid - 1);
    double t0 = now_ms();
    kill((pid_t)atoi(pid), SIGKILL);
    /* On shm a write into a dead process may fail as a refused access before the engine
     * sees the process gone (its pidfd): any error ends the write; the loop goes on until
     * the peer is reported unreachable. */
    fabric_status last = FABRIC_STATUS_OK, first = FABRIC_STATUS_OK;
    double first_ms = 0;
    while (now_ms() - t0 < 10000) {
        CHECK(fabric_write(e, src, 0, dst, 0, 4096, &op));
        last = fabric_op_wait(op, 10000);
        fabric_op_free(op);
        if (last == FABRIC_STATUS_ERR_TIMEOUT) break;
        if (last != FABRIC_STATUS_OK && first == FABRIC_STATUS_OK) {
            first = last;
            first_ms = now_ms() - t0;
        }
        if (last == FABRIC_STATUS_ERR_PEER_UNREACHABLE || last == FABRIC_STATUS_ERR_CONNECTION_LOST) break;
        usleep(1000);
    }
    if (last != FABRIC_STATUS_ERR_PEER_UNREACHABLE && last != FABRIC_STATUS_ERR_CONNECTION_LOST) {
        fprintf(stderr, "initiator: writes to a killed peer gave %s\n", fabric_status_name(last));
        return 1;
    }
    EXPECT(fabric_peer_status(e, peer), FABRIC_STATUS_ERR_PEER_UNREACHABLE);
    printf("initiator: killed peer seen after %.0f ms (first failed write after %.0f ms: %s; then %s)\n",
           now_ms() - t0, first_ms, fabric_status_name(first), fabric_status_name(last));

    fabric_remote_free(dst);
    fabric_region_free(src);
    fabric_region_free(back);
    fabric_engine_free(e);
    free(src_mem);
    free(back_mem);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s target|initiator PROVIDER DIR\n", argv[0]);
        return 2;
    }
    role = argv[1];
    if (strcmp(argv[1], "target") == 0) return target(argv[2], argv[3]);
    if (strcmp(argv[1], "initiator") == 0) return initiator(argv[2], argv[3]);
    return 2;
}
