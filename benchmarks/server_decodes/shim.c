// Times every llama_process call of a llama-server built with shared libraries
// (-DBUILD_SHARED_LIBS=ON), so that its decodes can be set beside pymtp's.
//
//   gcc -O2 -shared -fPIC -o shim.so shim.c -ldl
//   LD_PRELOAD=$PWD/shim.so SHIM_OUT=/tmp/decodes llama-server ...
//
// Each process appends "<context pointer> <start ms> <duration ms>" lines to
// $SHIM_OUT.<pid>; benchmarks/server_decodes/read.py reads them. A static server resolves
// llama_process inside its own binary, where no preload can reach it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef int32_t (*process_fn)(void *ctx, int type, void *batch);

static process_fn real_process;
static int out_fd = -1;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int32_t llama_process(void *ctx, int type, void *batch) {
    if (!real_process) {
        real_process = (process_fn) dlsym(RTLD_NEXT, "llama_process");
    }
    if (out_fd < 0) {
        const char *base = getenv("SHIM_OUT");
        char path[512];
        snprintf(path, sizeof path, "%s.%d", base ? base : "/tmp/decodes", (int) getpid());
        out_fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    double t0 = now_ms();
    int32_t rc = real_process(ctx, type, batch);
    double t1 = now_ms();
    char line[128];
    int n = snprintf(line, sizeof line, "%p %.4f %.4f\n", ctx, t0, t1 - t0);
    if (out_fd >= 0 && write(out_fd, line, n) != n) {
        // a lost line only shortens the record
    }
    return rc;
}
