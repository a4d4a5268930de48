#!/usr/bin/env python3
"""mooncake_synth.py — a synthetic Mooncake-format trace with a tool-and-agent
reuse pattern, the second trace of sgm-replay's hint figures (issue 30).

Job: write a JSON Lines trace (timestamp, input_length, output_length,
hash_ids: one id per 512-token block, a block's id naming its whole prefix, as
in the Mooncake traces; docs/traces.md) whose reuse differs from the
conversation trace's. The conversation trace reuses a session's prefix turns
later (user think time, long reuse distances); an agent workload instead
issues bursts of calls: a few long tool/system prompts shared by everyone
(heavily skewed), then a task context that the next steps of the same agent
loop extend a few requests later (short reuse distances), then a suffix of its
own. The request count is that of Mooncake's tool&agent trace (FAST'25 trace
release, toolagent_trace.jsonl: 23,608 requests, as the published copies of
the release list it); the sizes are not fitted to that trace: with the
defaults a request averages 9.5k input tokens (19.1 blocks) and 179 output
tokens (outputs exponential, mean 180). The published input average of the
tool&agent trace is not checked here (no source at hand gave it; 7,590 input
and 182 output tokens are the averages of the technical report's earlier
23,608-request trace, arXiv 2407.00079 section 4.2, a different trace). The
mix of prefixes, loops and steps is this generator's, not measured.
Deterministic for a seed. Python standard library only.

  mooncake_synth.py [--requests N] [--seed S] > trace.jsonl
"""
import argparse
import json
import random
import sys

BLOCK_TOKENS = 512


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=23608, help="requests to write (default 23608)")
    ap.add_argument("--seed", type=int, default=30, help="random seed (default 30)")
    ap.add_argument("--prompts", type=int, default=40, help="distinct tool/system prompts (default 40)")
    ap.add_argument("--loops", type=int, default=1500, help="agent loops running at once (default 1500)")
    a = ap.parse_args()
    if a.requests <= 0 or a.prompts <= 0 or a.loops <= 0:
        sys.exit("mooncake_synth.py: --requests, --prompts and --loops must be positive")
    rng = random.Random(a.seed)
    next_id = [0]

    def fresh(n):
        ids = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return ids

    # Tool/system prompts: 2 to 10 blocks each, picked with a Zipf-like skew.
    prompts = [fresh(rng.randint(2, 10)) for _ in range(a.prompts)]
    weights = [1.0 / (k + 1) ** 1.1 for k in range(a.prompts)]

    def new_loop():
        p = rng.choices(range(a.prompts), weights)[0]
        # The task: a context of 2 to 12 blocks, then 1 to 9 steps, each
        # appending 1 to 3 blocks to what the loop has seen.
        return {"chain": prompts[p] + fresh(rng.randint(2, 12)), "steps": rng.randint(1, 9)}

    loops = [new_loop() for _ in range(a.loops)]
    t = 0
    out = sys.stdout
    for _ in range(a.requests):
        k = rng.randrange(a.loops)
        lp = loops[k]
        # The step's own tail (its observation, partial last block): never reused.
        tail = fresh(1)
        ids = lp["chain"] + tail
        inp = (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        outl = max(1, int(rng.expovariate(1 / 180.0)))
        out.write(json.dumps({"timestamp": t, "input_length": inp, "output_length": outl,
                              "hash_ids": ids}) + "\n")
        t += rng.randint(0, 300)
        lp["steps"] -= 1
        if lp["steps"] <= 0:
            loops[k] = new_loop()
        else:
            lp["chain"] = lp["chain"] + fresh(rng.randint(1, 3))


if __name__ == "__main__":
    main()
