/*
 * standalone.c — the plain driver of a fuzz target: a main() that feeds every
 * file of the given folders (or the given files) to LLVMFuzzerTestOneInput
 * once, in name order, so that each target runs as a regression test over its
 * committed seed corpus with the normal compiler, in every configuration.
 * A target reports a broken invariant by aborting. Each input runs in a
 * forked child, so that one crash (abort, a sanitizer report, a leak found at
 * the child's exit) is reported with its input and the others still run; the
 * driver then exits 1, a normal failure that CTest's WILL_FAIL can invert
 * (a driver killed by a signal would always count as failed). It also fails
 * when a path cannot be read or a folder holds no input (a corpus that
 * vanished must not pass as "nothing crashed").
 *
 * Threading: none.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

/* Run one file in a child; 0 when it ran clean, -1 when it could not be read
 * or the child crashed or failed. */
static int standalone_run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *n = realloc(buf, cap);
      if (!n) {
        free(buf);
        fclose(f);
        return -1;
      }
      buf = n;
    }
    size_t r = fread(buf + len, 1, cap - len, f);
    len += r;
    if (r == 0) break;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    free(buf);
    fprintf(stderr, "cannot read %s\n", path);
    return -1;
  }
  printf("input %s (%zu bytes)\n", path, len);
  fflush(stdout);
  /* A copy of exactly len bytes, so that ASan sees any read past the input. */
  uint8_t *exact = malloc(len ? len : 1);
  if (!exact) {
    free(buf);
    return -1;
  }
  memcpy(exact, buf, len);
  free(buf);
  pid_t pid = fork();
  if (pid < 0) {
    free(exact);
    fprintf(stderr, "cannot fork for %s\n", path);
    return -1;
  }
  if (pid == 0) {
    LLVMFuzzerTestOneInput(exact, len);
    free(exact);
    exit(0); /* exit, not _exit: the leak checker runs at exit */
  }
  free(exact);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
  if (WIFSIGNALED(status))
    fprintf(stderr, "FAILED: %s: the target died of signal %d\n", path, WTERMSIG(status));
  else
    fprintf(stderr, "FAILED: %s: the target exited with status %d\n", path, WEXITSTATUS(status));
  return -1;
}

static int standalone_name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  size_t n_inputs = 0, n_failed = 0;
  for (int a = 1; a < argc; a++) {
    struct stat st;
    if (stat(argv[a], &st) != 0) {
      fprintf(stderr, "cannot stat %s\n", argv[a]);
      return 1;
    }
    if (!S_ISDIR(st.st_mode)) {
      if (standalone_run_file(argv[a]) != 0) n_failed++;
      n_inputs++;
      continue;
    }
    struct dirent **names = NULL;
    int n = scandir(argv[a], &names, NULL, NULL);
    if (n < 0) {
      fprintf(stderr, "cannot list %s\n", argv[a]);
      return 1;
    }
    char **paths = calloc((size_t)n + 1, sizeof *paths);
    size_t k = 0;
    for (int i = 0; i < n; i++) {
      if (names[i]->d_name[0] != '.' && paths &&
          asprintf(&paths[k], "%s/%s", argv[a], names[i]->d_name) >= 0)
        k++;
      free(names[i]);
    }
    free(names);
    if (!paths) return 1;
    qsort(paths, k, sizeof *paths, standalone_name_cmp);
    for (size_t i = 0; i < k; i++) {
      if (standalone_run_file(paths[i]) != 0) n_failed++;
      free(paths[i]);
    }
    free(paths);
    n_inputs += k;
  }
  if (n_inputs == 0) {
    fprintf(stderr, "no input found: the corpus is empty\n");
    return 1;
  }
  if (n_failed) {
    fprintf(stderr, "%zu of %zu inputs failed\n", n_failed, n_inputs);
    return 1;
  }
  printf("%zu inputs ran, every invariant held\n", n_inputs);
  return 0;
}
