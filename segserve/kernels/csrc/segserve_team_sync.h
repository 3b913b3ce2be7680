/* The decode stack's barrier: spin while spinning pays, sleep (futex) when it does not.
 *
 * Why: a batch-1 decode step crosses ~150 barriers (5 a layer), most after 10-80 us of work per thread.
 * libgomp's barrier spins GOMP_SPINCOUNT rounds and then sleeps; segserve sets that low (openmp.py),
 * because a thread spinning on a 2-core machine holds the core its descheduled peer needs when other
 * processes (a benchmark client, an HTTP loop) are runnable. On a quiet machine the low count costs: the
 * waiting thread is asleep when its peer arrives 10-100 us later, and waking a halted vCPU costs tens of
 * microseconds (batch-1 Q4_1 decode: 118 tok/s with GOMP_SPINCOUNT=1000 against 145 with 100000, in a
 * 4-round A/B on Zen 4; under one busy process the 100000 count fell to 5-34 tok/s against 54-63).
 *
 * So this barrier spins for a budget it adapts, shared by every call (a machine-wide condition):
 * a wait that ends while spinning doubles the budget (up to SYNC_SPIN_MAX pause rounds), one that has to
 * sleep divides it by 4 (down to SYNC_SPIN_MIN). Quiet, waits are short and the budget grows; with other
 * runnable processes a descheduled peer makes spins fail and the budget collapses to libgomp's behaviour
 * in a few barriers. The design is the adaptive spin-then-block wait of glibc's adaptive mutexes and of
 * Linux's optimistic spinning, applied to a sense-counting (generation) barrier.
 *
 * Use: sg_decode_stack puts a team_barrier on its frame, every thread of its region calls
 * team_sync_enter(&b) first and team_sync_leave() last; the worksharing loops its kernels run end in
 * `omp for nowait` plus team_sync(), which is this barrier inside such a region and `omp barrier`
 * anywhere else (sg_linear's own regions, or no region at all). Linux only (futex). */
#ifndef SEGSERVE_TEAM_SYNC_H
#define SEGSERVE_TEAM_SYNC_H

#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SYNC_SPIN_MIN 64
#define SYNC_SPIN_MAX (1 << 16)

typedef struct {
    atomic_int arrived;
    atomic_uint gen;      /* generation: bumped by the last thread to arrive; the futex word */
    atomic_int sleepers;  /* threads in (or about to enter) futex_wait on gen */
    int n;                /* team size */
} team_barrier;

/* The spin budget (pause rounds) every team_barrier starts from: defined in segserve_cpu.c. */
extern atomic_int sg_sync_spin;
/* The calling thread's barrier while it is inside sg_decode_stack's region, else NULL. */
extern __thread team_barrier *sg_sync_cur;

static inline void team_barrier_wait(team_barrier *b) {
    unsigned g = atomic_load_explicit(&b->gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&b->gen, 1); /* seq_cst: ordered before the sleepers load below */
        if (atomic_load(&b->sleepers)) syscall(SYS_futex, &b->gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    int budget = atomic_load_explicit(&sg_sync_spin, memory_order_relaxed);
    for (int i = 0; i < budget; i++) {
        if (atomic_load_explicit(&b->gen, memory_order_acquire) != g) {
            if (budget < SYNC_SPIN_MAX) atomic_store_explicit(&sg_sync_spin, 2 * budget, memory_order_relaxed);
            return;
        }
        _mm_pause();
    }
    atomic_fetch_add(&b->sleepers, 1); /* seq_cst: ordered before the gen load inside futex_wait */
    while (atomic_load(&b->gen) == g) syscall(SYS_futex, &b->gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
    int less = budget / 4;
    atomic_store_explicit(&sg_sync_spin, less < SYNC_SPIN_MIN ? SYNC_SPIN_MIN : less, memory_order_relaxed);
}

/* Every thread of the region, before the region's first (omp) barrier: this thread's pointer to b, and
 * (thread 0) the team size, which no thread reads before that barrier. */
static inline void team_sync_enter(team_barrier *b) {
    if (omp_get_thread_num() == 0) b->n = omp_get_num_threads();
    sg_sync_cur = b;
}

static inline void team_sync_leave(void) { sg_sync_cur = NULL; }

/* The end of a worksharing loop run with nowait: this thread waits for its team. */
static inline void team_sync(void) {
    team_barrier *b = sg_sync_cur;
    if (b) {
        team_barrier_wait(b);
    } else {
#pragma omp barrier
    }
}

#endif
