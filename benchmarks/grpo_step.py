"""The GRPO learner step's cost beside TRL's: the project's ``GRPOLearner.train_step`` and TRL's GRPOTrainer loss +
backward + grad-norm clip + AdamW step (``grpo/peer.py``'s ``trl_step``), on the same batch from the same weights,
one after the other, repeated; prints each side's median CPU-seconds (``time.process_time``: every thread of this
process) and wall seconds, and their ratios (project / TRL). docs/grpo.md "Parity and cost beside TRL" quotes it.

    python benchmarks/grpo_step.py                        # SmolLM2-135M (the embedded model), 16 sequences, 3 reps
    python benchmarks/grpo_step.py --reps 5 --threads 2 --prompts 4 --group 4 --prompt-tokens 96 --completion-tokens 64

Both sides run in this one process with the same torch thread count, fp32, the whole batch as one micro-batch, and
before every step both models are reset to the initial weights (and fresh optimizer state), so each rep times the
same step. The project's step scores each group's shared prompt once (docs/grpo.md); TRL's runs every row whole.
Needs trl (the test extra). Timings on a shared machine are noisy: compare the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch and the modules under test are imported in the functions that run them: --help needs none of them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local model directories only, and nothing reported off the machine
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def make_batch(prompts: int, group: int, prompt_tokens: int, completion_tokens: int, seed: int = 0):
    """``prompts`` x ``group`` samples (prompt ids shared within a group, all prompts one length so TRL's left
    padding shifts nothing) with completions of completion_tokens/2..completion_tokens, and group-relative
    advantages of fixed rewards."""
    import torch

    from es_ray.grpo.loss import group_advantages

    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(prompts):
        prompt = torch.randint(100, 20000, (prompt_tokens,), generator=g).tolist()
        for _ in range(group):
            n = int(torch.randint(completion_tokens // 2, completion_tokens + 1, (1,), generator=g))
            completion = torch.randint(100, 20000, (n,), generator=g).tolist()
            samples.append({"prompt_ids": prompt, "completion_ids": completion})
    rewards = torch.rand((prompts, group), generator=g).round()
    return samples, group_advantages(rewards).flatten().tolist()


def timed(fn) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="model directory (default: the embedded SmolLM2-135M)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--completion-tokens", type=int, default=64)
    ap.add_argument("--loss-type", default="grpo", choices=["grpo", "dr_grpo", "dapo"])
    args = ap.parse_args(argv)

    import torch

    from es_ray.grpo.config import to_grpo_config
    from es_ray.grpo.learner import GRPOLearner
    from es_ray.grpo.peer import trl_inputs, trl_step, trl_trainer
    from es_ray.models import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model(args.model))
    samples, adv = make_batch(args.prompts, args.group, args.prompt_tokens, args.completion_tokens)
    batch = len(samples)
    cfg = {
        "model": {"path": model_dir},
        "engine": {"threads": args.threads},
        "sampling": {"temperature": 1.0, "max_new_tokens": args.completion_tokens},
        "grpo": {
            "lr": 1e-5,
            "micro_batch_size": batch,
            "loss_type": args.loss_type,
            "group_size": args.group,
            "prompts_per_step": args.prompts,
        },
    }
    ours = GRPOLearner(to_grpo_config(cfg))
    trainer = trl_trainer(
        model_dir, group_size=args.group, max_tokens=args.completion_tokens, loss_type=args.loss_type, lr=1e-5
    )
    torch.set_num_threads(args.threads)  # the learner sets its own; both sides run on the same count
    inputs = trl_inputs(samples, adv, trainer.processing_class.pad_token_id)
    initial = {n: p.detach().clone() for n, p in ours.named.items()}

    def reset():
        with torch.no_grad():
            for n, w in initial.items():
                ours.named[n].copy_(w)
                trainer.model.get_parameter(n).copy_(w)
        ours.optimizer.state.clear()
        if trainer.optimizer is not None:
            trainer.optimizer.state.clear()

    times = {"project": [], "trl": []}
    for rep in range(args.reps + 1):  # rep 0 warms both up and is not counted
        reset()
        a = timed(lambda: ours.train_step(samples, adv))
        reset()
        b = timed(lambda: trl_step(trainer, inputs))
        if rep:
            times["project"].append(a)
            times["trl"].append(b)
        print(
            f"rep {rep}{' (warm-up)' if not rep else ''}: project {a[0]:.2f} CPU-s / {a[1]:.2f} s, "
            f"TRL {b[0]:.2f} CPU-s / {b[1]:.2f} s",
            flush=True,
        )
    med = {
        side: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) for side, ts in times.items()
    }
    out = {
        "batch": batch,
        "prompt_tokens": args.prompt_tokens,
        "completion_tokens_max": args.completion_tokens,
        "loss_type": args.loss_type,
        "threads": args.threads,
        "reps": args.reps,
        "project_cpu_s": round(med["project"][0], 3),
        "trl_cpu_s": round(med["trl"][0], 3),
        "project_wall_s": round(med["project"][1], 3),
        "trl_wall_s": round(med["trl"][1], 3),
        "cpu_ratio": round(med["project"][0] / med["trl"][0], 3),
        "wall_ratio": round(med["project"][1] / med["trl"][1], 3),
    }
    print(
        f"median of {args.reps}: project {out['project_cpu_s']} CPU-s / {out['project_wall_s']} s, TRL "
        f"{out['trl_cpu_s']} CPU-s / {out['trl_wall_s']} s; project / TRL: {out['cpu_ratio']}x CPU, "
        f"{out['wall_ratio']}x wall"
    )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
