/*
 * synth.c — synthetic allocation streams for the replay core: what a PyTorch
 * training loop asks of its allocator, without a GPU or a profiler trace.
 *
 * replay_trace_transformer: iterations of one training step of a small
 * decoder-only transformer (GPT-2 small: 12 layers, hidden 768, 12 heads,
 * MLP 4 x hidden, vocabulary 32,000; batch 4 x 512 tokens, 2-byte elements):
 *  - once, before the first step: the weights (per layer: QKV, projection,
 *    two MLP matrices, biases and norms; the embedding) and, at the first
 *    optimizer step, Adam's two fp32 moments per weight (kept);
 *  - forward, per layer: the activations autograd saves (norm outputs and
 *    their per-token statistics, QKV, attention probabilities and their
 *    dropout mask, the MLP's two wide tensors, the residual sums), plus
 *    workspaces freed at once (cuBLAS, a 1-8 MiB size drawn per step);
 *  - the logits and the loss; backward frees the logits, then per layer in
 *    reverse allocates the input gradients, frees the layer's saved tensors
 *    and allocates the weight gradients (the first time each step: gradients
 *    are set to None after the optimizer, PyTorch's default zero_grad);
 *  - the optimizer step: small temporaries per weight, then the gradients go.
 * The sizes repeat every step but the workspaces, so a warm allocator should
 * make no driver call after the first step.
 *
 * Threading: none.
 */
#include <stdlib.h>
#include <string.h>

#include "replay.h"

enum {
  SYN_LAYERS = 12,
  SYN_HEADS = 12,
};
#define SYN_B UINT64_C(4)
#define SYN_S UINT64_C(512)
#define SYN_H UINT64_C(768)
#define SYN_V UINT64_C(32000)
#define SYN_E UINT64_C(2) /* bytes per element (bf16) */

typedef struct syn {
  replay_trace *t;
  bool failed;
  uint64_t rng; /* xorshift64 state */
} syn;

/* Room for one more element in *arr (used of *cap, elem bytes each, doubling
 * from first); false (s->failed) when out of memory. */
static bool syn_reserve(syn *s, void **arr, size_t *cap, size_t used, size_t elem, size_t first) {
  if (s->failed) return false;
  if (used < *cap) return true;
  size_t n = *cap ? *cap * 2 : first;
  void *a = realloc(*arr, n * elem);
  if (!a) {
    s->failed = true;
    return false;
  }
  *arr = a;
  *cap = n;
  return true;
}

static void syn_event(syn *s, uint32_t e) {
  replay_trace *t = s->t;
  if (syn_reserve(s, (void **)&t->ev, &t->cap_ev, t->n_ev, sizeof *t->ev, 4096)) t->ev[t->n_ev++] = e;
}

static uint32_t syn_alloc(syn *s, uint64_t bytes) {
  replay_trace *t = s->t;
  size_t cap = t->cap_blocks;
  bool ok = syn_reserve(s, (void **)&t->size, &cap, t->n_blocks, sizeof *t->size, 1024);
  t->cap_blocks = (uint32_t)cap;
  if (!ok) return 0;
  uint32_t id = t->n_blocks++;
  t->size[id] = bytes;
  syn_event(s, id);
  return id;
}

static void syn_free(syn *s, uint32_t id) { syn_event(s, id | REPLAY_EV_FREE); }

static uint64_t syn_rand(syn *s, uint64_t lo, uint64_t hi) {
  uint64_t x = s->rng;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  s->rng = x;
  return lo + x % (hi - lo + 1);
}

/* A cuBLAS-like workspace, allocated and freed at once (1-8 MiB, 256-aligned). */
static void syn_workspace(syn *s) {
  syn_free(s, syn_alloc(s, syn_rand(s, 4096, 32768) * 256));
}

/* Per layer: the weights' sizes in bytes. */
static const uint64_t syn_weights[] = {
    SYN_H * 3 * SYN_H * SYN_E, 3 * SYN_H * SYN_E, /* QKV */
    SYN_H * SYN_H * SYN_E, SYN_H * SYN_E,         /* projection */
    SYN_H * 4 * SYN_H * SYN_E, 4 * SYN_H * SYN_E, /* MLP up */
    4 * SYN_H * SYN_H * SYN_E, SYN_H * SYN_E,     /* MLP down */
    SYN_H * SYN_E, SYN_H * SYN_E, SYN_H * SYN_E, SYN_H * SYN_E, /* two norms */
};
#define SYN_N_WEIGHTS (sizeof syn_weights / sizeof syn_weights[0])
/* The saved activations of one layer's forward pass, in allocation order. */
static const uint64_t syn_saved[] = {
    SYN_B * SYN_S * SYN_H * SYN_E,                         /* norm 1 output */
    SYN_B * SYN_S * 4, SYN_B * SYN_S * 4,                  /* its mean and rstd */
    SYN_B * SYN_S * 3 * SYN_H * SYN_E,                     /* QKV */
    SYN_B * SYN_HEADS * SYN_S * SYN_S * SYN_E,             /* attention probabilities */
    SYN_B * SYN_HEADS * SYN_S * SYN_S,                     /* their dropout mask */
    SYN_B * SYN_S * SYN_H * SYN_E,                         /* attention output */
    SYN_B * SYN_S * SYN_H,                                 /* residual dropout mask */
    SYN_B * SYN_S * SYN_H * SYN_E,                         /* residual sum */
    SYN_B * SYN_S * SYN_H * SYN_E,                         /* norm 2 output */
    SYN_B * SYN_S * 4, SYN_B * SYN_S * 4,                  /* its mean and rstd */
    SYN_B * SYN_S * 4 * SYN_H * SYN_E,                     /* MLP up */
    SYN_B * SYN_S * 4 * SYN_H * SYN_E,                     /* GELU output */
    SYN_B * SYN_S * SYN_H,                                 /* residual dropout mask */
    SYN_B * SYN_S * SYN_H * SYN_E,                         /* residual sum: the next layer's input */
};
#define SYN_N_SAVED (sizeof syn_saved / sizeof syn_saved[0])

int replay_trace_transformer(replay_trace *t, unsigned iters, uint64_t seed, char *err,
                             size_t err_len) {
  memset(t, 0, sizeof *t);
  t->format = REPLAY_FMT_CSV;
  syn s = {.t = t, .rng = seed ? seed : 1};
  uint32_t weight[SYN_LAYERS][SYN_N_WEIGHTS], grad[SYN_LAYERS][SYN_N_WEIGHTS];
  uint32_t embed = syn_alloc(&s, SYN_V * SYN_H * SYN_E), embed_grad = 0;
  for (int l = 0; l < SYN_LAYERS; l++)
    for (size_t w = 0; w < SYN_N_WEIGHTS; w++) weight[l][w] = syn_alloc(&s, syn_weights[w]);
  (void)weight;
  for (unsigned it = 0; it < iters; it++) {
    uint32_t saved[SYN_LAYERS][SYN_N_SAVED];
    uint32_t x = syn_alloc(&s, SYN_B * SYN_S * SYN_H * SYN_E); /* embedding output */
    for (int l = 0; l < SYN_LAYERS; l++) {
      for (size_t k = 0; k < SYN_N_SAVED; k++) {
        saved[l][k] = syn_alloc(&s, syn_saved[k]);
        if (k == 3 || k == 12) syn_workspace(&s); /* the GEMMs */
        if (k == 4) { /* softmax's scratch: raw scores, freed once normalised */
          syn_free(&s, syn_alloc(&s, SYN_B * SYN_HEADS * SYN_S * SYN_S * SYN_E));
        }
      }
    }
    uint32_t logits = syn_alloc(&s, SYN_B * SYN_S * SYN_V * SYN_E);
    uint32_t loss = syn_alloc(&s, 512);
    uint32_t dlogits = syn_alloc(&s, SYN_B * SYN_S * SYN_V * SYN_E);
    syn_free(&s, loss);
    syn_free(&s, logits);
    uint32_t dx = syn_alloc(&s, SYN_B * SYN_S * SYN_H * SYN_E);
    if (!embed_grad) embed_grad = syn_alloc(&s, SYN_V * SYN_H * SYN_E);
    syn_free(&s, dlogits);
    for (int l = SYN_LAYERS - 1; l >= 0; l--) {
      /* Input gradients of the wide tensors, then the layer's saved tensors go. */
      uint32_t dup = syn_alloc(&s, SYN_B * SYN_S * 4 * SYN_H * SYN_E);
      syn_workspace(&s);
      for (size_t w = 0; w < SYN_N_WEIGHTS; w++) grad[l][w] = syn_alloc(&s, syn_weights[w]);
      uint32_t dattn = syn_alloc(&s, SYN_B * SYN_HEADS * SYN_S * SYN_S * SYN_E);
      syn_workspace(&s);
      syn_free(&s, dup);
      for (size_t k = SYN_N_SAVED; k-- > 0;) syn_free(&s, saved[l][k]);
      syn_free(&s, dattn);
      uint32_t ndx = syn_alloc(&s, SYN_B * SYN_S * SYN_H * SYN_E);
      syn_free(&s, dx);
      dx = ndx;
    }
    syn_free(&s, dx);
    syn_free(&s, x);
    /* Adam: the moments at the first step (kept), temporaries per weight. */
    if (it == 0) {
      syn_alloc(&s, SYN_V * SYN_H * 4);
      syn_alloc(&s, SYN_V * SYN_H * 4);
      for (int l = 0; l < SYN_LAYERS; l++)
        for (size_t w = 0; w < SYN_N_WEIGHTS; w++) {
          syn_alloc(&s, syn_weights[w] * 2);
          syn_alloc(&s, syn_weights[w] * 2);
        }
    }
    for (int l = 0; l < SYN_LAYERS; l++)
      for (size_t w = 0; w < SYN_N_WEIGHTS; w++) {
        syn_free(&s, syn_alloc(&s, syn_weights[w] * 2));
        syn_free(&s, grad[l][w]); /* zero_grad(set_to_none=True) */
      }
    syn_free(&s, embed_grad);
    embed_grad = 0;
  }
  (void)embed;
  if (s.failed) {
    replay_trace_free(t);
    return replay_fail(err, err_len, "out of memory building the synthetic transformer stream");
  }
  return replay_trace_finish(t, err, err_len);
}
