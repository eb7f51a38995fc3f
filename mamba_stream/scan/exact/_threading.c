/* The pool: the helper threads a job's parts run on (`pool_run`).
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * No twin: the pool changes no bit. `_threading.py` sets when it is used, and on how many
 * threads. */

/* --- kernels on several threads: the pool ------------------------------------------------- */
/* A job (a product, a scan) is cut into parts of contiguous work units (runs of 16 outputs,
 * blocks of channels); each unit is computed whole by one thread, so how the parts fall changes
 * no bit. The calling thread and up to POOL_MAX - 1 helper threads claim parts one at a time
 * from one atomic word (generation, parts, next part): a helper that the OS has not run yet
 * claims nothing, and the caller computes what is left itself, so a loaded machine never waits
 * on a thread that is not running. Helpers spin for a while between jobs (a decode step hands
 * them a product every 50-500 us, and waking a sleeping thread costs about as much as a small
 * product), yielding the core now and then, then sleep on a condition variable. Python's thread
 * pool cost 0.1-0.4 ms a hand-off on a 2-core VM, more than half a decode product gains from the
 * second core. One job at a time: a second caller that finds the pool busy computes its whole
 * job on its own thread. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define POOL_MAX 64
#define POOL_SPIN 20000 /* pause loops before a helper sleeps: about 100-400 us */

typedef void (*part_fn)(const void *job, i64 u0, i64 u1); /* work units [u0, u1) of a job */

static struct {
    pthread_mutex_t job_lock;   /* held by the caller whose job is out */
    pthread_mutex_t sleep_lock; /* guards the sleep below */
    pthread_cond_t wake;
    /* generation << 32 | parts << 16 | next part to claim; a new generation per job */
    atomic_uint_fast64_t claim;
    atomic_int done;     /* parts of this job finished */
    atomic_int sleepers; /* helpers on the condition variable, or about to be */
    int started;         /* helpers running */
    part_fn fn;
    const void *job;
    i64 units;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and compute parts of generation `gen` until none is left. */
static void pool_work(uint64_t gen) {
    uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        uint64_t parts = (c >> 16) & 0xffff, next = c & 0xffff;
        if (c >> 32 != gen || next >= parts) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* the part is ours: the caller waits for it, so the job's fields stay this job's */
        i64 u0 = pool.units * (i64)next / (i64)parts, u1 = pool.units * (i64)(next + 1) / (i64)parts;
        if (u0 < u1) pool.fn(pool.job, u0, u1);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *pool_helper(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&pool.claim) >> 32;
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.claim, memory_order_acquire) >> 32) == seen && spins < POOL_SPIN) {
            cpu_relax();
            if (++spins % 256 == 0) sched_yield(); /* a loaded machine gets the core back */
        }
        if (g == seen) {
            atomic_fetch_add(&pool.sleepers, 1);
            pthread_mutex_lock(&pool.sleep_lock);
            while ((g = atomic_load(&pool.claim) >> 32) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            pthread_mutex_unlock(&pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = g;
        pool_work(g);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has none of the parent's helper threads */
    pthread_mutex_init(&pool.job_lock, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

/* Start helpers until `threads` - 1 run (fewer if the OS refuses one). */
static void pool_grow(int threads) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    while (pool.started < threads - 1 && pool.started < POOL_MAX - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, pool_helper, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
}

/* fn(job, u0, u1) over the work units [0, units), in up to `threads` contiguous parts. */
static void pool_run(part_fn fn, const void *job, i64 units, int threads) {
    if (threads > units) threads = (int)units;
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (threads <= 1 || pthread_mutex_trylock(&pool.job_lock) != 0) {
        fn(job, 0, units);
        return;
    }
    pool_grow(threads);
    pool.fn = fn;
    pool.job = job;
    pool.units = units;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load(&pool.claim) >> 32) + 1;
    atomic_store_explicit(&pool.claim, (gen & 0xffffffffu) << 32 | (uint64_t)threads << 16, memory_order_seq_cst);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    pool_work(gen & 0xffffffffu);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < threads;)
        if (++spins % 256 == 0) sched_yield(); /* a helper computing a part, off the CPU */
        else cpu_relax();
    pthread_mutex_unlock(&pool.job_lock);
}
