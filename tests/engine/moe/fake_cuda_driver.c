/* A stand-in libcuda.so.1 for testing the CPU executor's eager device handoff without a GPU
 * (tests/engine/moe/test_cpu_executor.py): "device" pointers are host pointers, and every async copy
 * goes to a FIFO "stream" thread that runs it after a delay, so a CPU job that started before its
 * ready flag landed would read stale inputs and fail the comparison. */
#include <pthread.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

typedef struct { void* dst; const void* src; size_t n; } Copy;
#define QN 4096
static Copy q[QN];
static long head = 0, tail = 0, calls = 0;
static void* last_stream = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER, idle = PTHREAD_COND_INITIALIZER;
static pthread_t th;
static int started = 0, ctx_token = 0;
static void* cur_ctx = 0;

static void* run(void* arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&mu);
    while (head == tail) pthread_cond_wait(&cv, &mu);
    Copy c = q[head % QN];
    pthread_mutex_unlock(&mu);
    usleep(200); /* the GPU is behind the host */
    memcpy(c.dst, c.src, c.n);
    __sync_synchronize();
    pthread_mutex_lock(&mu);
    head++;
    pthread_cond_broadcast(&idle);
    pthread_mutex_unlock(&mu);
  }
  return 0;
}

static int enqueue(void* dst, const void* src, size_t n, void* stream) {
  pthread_mutex_lock(&mu);
  if (!started) { pthread_create(&th, 0, run, 0); started = 1; }
  q[tail % QN] = (Copy){dst, src, n};
  tail++;
  calls++;
  last_stream = stream;
  pthread_cond_signal(&cv);
  pthread_mutex_unlock(&mu);
  return 0;
}

int cuMemcpyDtoHAsync_v2(void* dst, unsigned long long src, size_t n, void* s) { return enqueue(dst, (const void*)src, n, s); }
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void* src, size_t n, void* s) { return enqueue((void*)dst, src, n, s); }
int cuCtxGetCurrent(void** c) { *c = cur_ctx ? cur_ctx : &ctx_token; return 0; }
int cuCtxSetCurrent(void* c) { cur_ctx = c; return 0; }
int cuGetErrorString(int r, const char** s) { (void)r; *s = "fake driver"; return 0; }

/* test helpers: wait until the stream ran every copy; copies enqueued so far; the last stream handle */
void fake_sync(void) {
  pthread_mutex_lock(&mu);
  while (head != tail) pthread_cond_wait(&idle, &mu);
  pthread_mutex_unlock(&mu);
}
long fake_calls(void) { return calls; }
long fake_last_stream(void) { return (long)last_stream; }
