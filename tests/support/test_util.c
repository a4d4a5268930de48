/* test_util.c — see test_util.h. */
#include "test_util.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

uint64_t sgm_test_seed(const char *suite, uint64_t fallback) {
  const char *s = getenv("SGM_TEST_SEED");
  uint64_t seed = s && *s ? strtoull(s, NULL, 0) : fallback;
  printf("# %s: seed %llu (set SGM_TEST_SEED to replay)\n", suite, (unsigned long long)seed);
  fflush(stdout);
  return seed;
}

void sgm_test_rng_init(sgm_test_rng *r, uint64_t seed) {
  r->s = seed ? seed : 0x9E3779B97F4A7C15ull;
}

uint64_t sgm_test_rng_next(sgm_test_rng *r) {
  uint64_t x = r->s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  r->s = x;
  return x * 0x2545F4914F6CDD1Dull;
}

uint64_t sgm_test_rng_range(sgm_test_rng *r, uint64_t lo, uint64_t hi) {
  if (hi <= lo) return lo;
  return lo + sgm_test_rng_next(r) % (hi - lo + 1);
}

uint64_t sgm_test_rng_log_range(sgm_test_rng *r, uint64_t lo, uint64_t hi) {
  double u = (double)(sgm_test_rng_next(r) >> 11) / 9007199254740992.0;
  double v = exp(log((double)lo) + u * (log((double)hi) - log((double)lo)));
  uint64_t x = (uint64_t)v;
  return x < lo ? lo : x > hi ? hi : x;
}

void sgm_test_clean_env(void) {
  for (;;) {
    char name[256] = "";
    for (char **e = environ; *e; e++) {
      if (strncmp(*e, "SGM_", 4) == 0 && strncmp(*e, "SGM_TEST_SEED=", 14) != 0) {
        const char *eq = strchr(*e, '=');
        size_t n = eq ? (size_t)(eq - *e) : strlen(*e);
        if (n < sizeof name) {
          memcpy(name, *e, n);
          name[n] = '\0';
          break;
        }
      }
    }
    if (!name[0]) break;
    unsetenv(name);
  }
  unsetenv("TF_FORCE_GPU_ALLOW_GROWTH");
  unsetenv("CUDA_DEVICE_MEMORY_LIMIT");
  for (int d = 0; d < 16; d++) {
    char n[64];
    snprintf(n, sizeof n, "CUDA_DEVICE_MEMORY_LIMIT_%d", d);
    unsetenv(n);
  }
  setenv("SGM_BACKEND", "emu", 1);
  setenv("SGM_VERBOSE", "0", 1);
  /* Suites that run at once must not share budgets through a device's node
   * registry (the driver double's GPUs have one PCI bus id in every
   * process); the node suite turns it on with its own SGM_NODE_DIR. */
  setenv("SGM_NODE", "off", 1);
}

int sgm_test_fork_capture(void (*child)(void *arg), void *arg, char *out, size_t len) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], STDERR_FILENO);
    close(fds[0]);
    close(fds[1]);
    child(arg);
    _exit(5); /* child() must not return */
  }
  close(fds[1]);
  /* Read to the end before waiting: a child blocked on a full pipe never ends. */
  size_t n = 0;
  char sink[256];
  ssize_t r;
  while ((r = read(fds[0], n + 1 < len ? out + n : sink, n + 1 < len ? len - 1 - n : sizeof sink)) > 0)
    if (n + 1 < len) n += (size_t)r;
  if (len) out[n] = '\0';
  close(fds[0]);
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  return status;
}

void sgm_test_assert_aborted(int status, const char *out, const char *needle) {
  if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT)
    fail_msg("the child did not abort (status 0x%x); its stderr: %s", status, out);
  if (!strstr(out, needle)) fail_msg("the child's stderr lacks \"%s\": %s", needle, out);
}
