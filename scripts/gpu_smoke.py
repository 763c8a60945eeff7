"""The one device check for a GPU machine with torch and transformers only (no vLLM, no Ray, nothing downloaded).

    python scripts/gpu_smoke.py                      # Qwen2-shaped 0.5B and 1.5B, bf16, CUDA: a few minutes on an H200
    python scripts/gpu_smoke.py --tiny --device cpu  # the same code on a tiny Qwen2-shaped model (CI, seconds)

For each model, randomly initialised (seeded, std 0.02, norms 1) and saved with a byte-level tokenizer built here:

* engine: a real forward (teacher-forced log-probs, finite) and a greedy generation through the transformers engine
  (``es_ray.engines.hf.HFEngine``) on the device;
* ES full rank through the engine's replica host: perturb changes the weights and the greedy output, restore gives
  cast(master) back bit for bit and the base model's greedy output, an Adam update is realised (cos > 0.9); the
  replica's measured peak memory beside the engine against the memory plan's ES part (``es_ray.memory_plan``);
* low rank: every member's greedy completions from one batched generation equal that member generated alone (on a
  GPU, whose bf16 kernels are not batch-invariant: its teacher-forced logits, within the base model's own batch noise);
* counter noise: the device's equals the CPU's bit for bit at odd element offsets and odd row slices;
* GRPO: a 2-step grpo.dtype=bf16_mixed learner (``es_ray.grpo.learner.GRPOLearner``), its measured peak memory against
  the plan's learner part;
* the sharded learner: a world-size-1 group over tcp://127.0.0.1 (NCCL with gloo beside it on a GPU, gloo on CPU;
  a host and a device all-reduce on it), FSDP2 with grpo.offload=all, built from the meta device (its build peak
  against the plan's build lines), a clipped step, a weight-sync chunk through full_tensor() and a sharded save and
  load (the rank's rows read back);
* colocation: the engine's share of the card (es_ray.memory_plan.engine_share) beside the learner's resident lines
  against torch.cuda.mem_get_info, allocated together; the colocated sync's chunks left on the device;
* timings: an ES iteration (full rank: perturb, generate, restore per member, then the update; low rank: one batched
  generation, then the update) against bare batched generation of the same rows, each the median of --repeats runs
  after a warm-up. The batch is --population x --prompts rows; whether it reaches the GPU's throughput plateau is
  for the caller to check by raising both (not swept here).

What only a multi-GPU machine with vLLM can confirm is printed at the end (``UNCONFIRMED``).

Peak memory is what CUDA's caching allocator reserved at its peak (``max_memory_reserved``; the allocated peak
beside it), against the plan's part less its CUDA-context line (n/a on CPU). The last line of the output is one
JSON object with every figure; ``ok`` says whether every check passed (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout (no install)

from es_ray import noise  # noqa: E402
from es_ray.core.config import EngineConfig, ModelConfig, SamplingConfig  # noqa: E402
from es_ray.engines.hf import HFEngine  # noqa: E402
from es_ray.engines.hf_lowrank import LowRankTerms  # noqa: E402
from es_ray.grpo.colocated import planned_engine_config  # noqa: E402
from es_ray.grpo.config import GRPOConfig, GRPOEngineConfig, GRPOSamplingConfig, GRPOTrainConfig, to_grpo_config  # noqa: E402
from es_ray.grpo.learner import GRPOLearner  # noqa: E402
from es_ray.memory_plan import (
    CARD_NAMES,
    ES_SLACK_BYTES,
    PRESETS,
    GiB,
    ModelShape,
    Settings,
    card_bytes,
    plan_es,
    plan_for,
    plan_grpo,
    usable_bytes,
)  # noqa: E402
from es_ray.noise import NoiseSource, counter_chunk, counter_noise, derive_seed  # noqa: E402
from es_ray.replica import ReplicaSpec  # noqa: E402
from es_ray.runtime.process_group import backend_kinds  # noqa: E402
from es_ray.strategy import ask, shape_fitness  # noqa: E402

# transformers and tokenizers are imported by the checks that use them: --help needs neither.

QWEN_0_5B = dict(
    model_type="qwen2",
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
)
"""Qwen2.5-0.5B-Instruct's config.json numbers."""
MODELS = {"qwen2.5-0.5b-shaped": QWEN_0_5B, "qwen2.5-1.5b-shaped": PRESETS["qwen2.5-1.5b"]}
TINY = {
    "tiny-qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
}
FILL_CHUNK = 1 << 26
"""Elements per randn draw while filling the weights (a 256 MB fp32 temporary at most)."""
EMBED_STD = 0.002
"""The embeddings' std: with the layers' 0.02, the residual stream is the layers' output rather than the input
token's embedding, so a tied LM head does not just repeat the last token, and the greedy output depends on the
weights (which the perturbation and low-rank checks need)."""
UNCONFIRMED = (
    "NCCL exchanging data across GPUs (a world of one moves nothing)",
    "grpo.colocate=true with vLLM in the learner's process (its default process group, sleep mode)",
    "vLLM's GPU weight writes, LoRA kernels and V2 model runner",
)
"""What this script cannot reach on one GPU with torch and transformers; its output says so."""
SMOKE_HOST_SLACK = 64 << 20
"""Host bytes the build may add beyond the plan's lines: the process group, FSDP2's bookkeeping, allocator pages
(measured 22 MiB on SmolLM2-135M at grpo.fsdp_size=2: benchmarks/learner_build.py)."""
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PROMPTS = (
    "What is 17 + 25? Answer:",
    "Name a prime number larger than 100.",
    "Sort the letters of 'smoke'.",
    "2, 4, 8, 16, next:",
    "Translate 'cat' to French:",
    "Q: Is 91 prime?\nA:",
    "def add(a, b):",
    "The capital of France is",
)


def byte_tokenizer(vocab_size: int, out: Path) -> int:
    """A byte-level tokenizer (every byte one token, no merges), the special tokens, and unused filler tokens up to
    the model's vocabulary (so every id the model can emit decodes), saved into ``out``; returns the end token's id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    return vocab[SPECIALS[0]]


def build_model_dir(fields: dict, device: torch.device, seed: int, out: Path) -> None:
    """Random bf16 weights, std 0.02 (norm weights 1), each tensor from its own seeded generator (the same model on
    every run), built on ``device`` without init kernels and saved as safetensors with ``byte_tokenizer``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    eos = byte_tokenizer(fields["vocab_size"], out)
    cfg = AutoConfig.for_model(**fields, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            gen.manual_seed(seed * 1_000_003 + i)
            std = EMBED_STD if "embed_tokens" in name or "lm_head" in name else 0.02
            flat = p.view(-1)
            for a in range(0, flat.numel(), FILL_CHUNK):
                part = flat[a : a + FILL_CHUNK]
                part.copy_(torch.randn(part.shape, generator=gen, device=device).mul_(std))
    model.save_pretrained(out, safe_serialization=True)
    del model


def spec(**changes) -> ReplicaSpec:
    base = dict(
        run_seed=0,
        noise="per_tensor",
        noise_table_size=1 << 20,
        noise_scope="per_tensor",
        trainable="",
        optimizer="adam",
        lr=1e-3,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        weight_decay=0.0,
        anchor_decay=0.0,
        perturbation="full",
        rank=4,
    )
    return ReplicaSpec(**{**base, **changes})


class Smoke:
    def __init__(self, device: torch.device):
        self.device = device
        self.checks: dict[str, bool] = {}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks[name] = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def median_s(self, fn, repeats: int) -> float:
        """Seconds of ``fn``: the median of ``repeats`` timed runs after one untimed warm-up (kernels compiled or
        picked, caches filled), so a figure is a measurement, not a first call."""
        fn()
        return sorted(self.timed(fn)[1] for _ in range(repeats))[repeats // 2]

    def start_peak(self) -> tuple[int, int] | None:
        """Resets CUDA's peak counters; returns what is allocated and reserved now (the base the next peaks are
        measured from)."""
        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)

    def peak_since(self, base: tuple[int, int] | None) -> tuple[int, int] | None:
        """(allocated, reserved) peaks above ``base``: reserved is what the caching allocator held from the device,
        the figure a plan must cover."""
        if base is None:
            return None
        return (
            torch.cuda.max_memory_allocated(self.device) - base[0],
            torch.cuda.max_memory_reserved(self.device) - base[1],
        )

    def memory(self, key: str, name: str, measured: tuple[int, int] | None, plan, part: str, fig: dict) -> None:
        """The plan's ``part`` against the measured peaks; the check is on the reserved peak, against the part less
        its CUDA-context line (which lies outside torch's allocator)."""
        planned = plan.part(part)
        context = sum(line.nbytes for line in plan.lines if line.part == part and line.item == "CUDA context")
        fig[f"{name}_planned_bytes"] = planned
        fig[f"{name}_measured_bytes"], fig[f"{name}_reserved_bytes"] = measured or (None, None)
        if measured is None:
            print(f"memory {key}/{name}: planned {planned / GiB:.3f} GiB, measured n/a ({self.device.type})")
            return
        allocated, reserved = measured
        budget = planned - context
        self.check(
            f"{key}/{name}_memory_within_plan",
            reserved <= budget,
            f"reserved peak {reserved / GiB:.3f} (allocated {allocated / GiB:.3f}) <= planned "
            f"{budget / GiB:.3f} GiB without the CUDA context ({reserved / max(budget, 1):.2f} of the plan)",
        )


def ids(completions) -> list[tuple[int, ...]]:
    return [tuple(c.token_ids) for c in completions]


def check_engine(smoke: Smoke, engine, prompts: list[str], greedy: SamplingConfig, key: str, fig: dict) -> list:
    prompt_ids = engine.tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    completion_ids = engine.tokenizer(" 42", add_special_tokens=False)["input_ids"]
    logprobs = engine.token_logprobs(prompt_ids, completion_ids)
    smoke.check(
        f"{key}/forward_finite",
        len(logprobs) == len(completion_ids) and all(lp == lp and lp <= 0 and lp > -1e4 for lp in logprobs),
        f"log-probs {[round(x, 3) for x in logprobs]}",
    )
    base, seconds = smoke.timed(lambda: engine.generate(prompts, greedy, seed=0))
    tokens = sum(c.num_tokens for c in base)
    fig["generate"] = {"rows": len(prompts), "tokens": tokens, "seconds": round(seconds, 3)}
    smoke.check(
        f"{key}/generation",
        tokens > 0 and all(c.num_tokens > 0 for c in base),
        f"{tokens} tokens for {len(prompts)} prompts in {seconds:.2f} s",
    )
    return base


def check_full_rank(smoke: Smoke, engine, shape: ModelShape, prompts, greedy, base, args, key: str, fig: dict):
    host = engine.replica_host()
    plan = plan_es(shape, Settings(engine_dtype_bytes=engine.dtype.itemsize, optimizer="adam", noise="per_tensor"))
    members = ask(args.population)
    fitness = shape_fitness([float(i % 3) for i in range(args.population)])
    mem_base = smoke.start_peak()  # the replica's own memory: setup, perturb/restore, an Adam update; no generation
    host.setup(spec())
    host.perturb(0, 0, 1, args.sigma)
    host.restore()
    stats = host.update(0, members, fitness, args.sigma)
    smoke.memory(key, "es_replica", smoke.peak_since(mem_base), plan, "es", fig)
    updated = engine.generate(prompts, greedy, seed=0)
    host.perturb(1, 0, 1, args.sigma)
    changed = sum(host.replica.engine_mismatches().values())
    perturbed = engine.generate(prompts, greedy, seed=0)
    host.restore()
    bad = host.replica.engine_mismatches()
    restored = engine.generate(prompts, greedy, seed=0)
    fig.update(perturb_changed_elements=changed, restore_bit_mismatches=sum(bad.values()), update=stats)
    smoke.check(
        f"{key}/perturb_changes_weights_and_output",
        changed > 0 and ids(perturbed) != ids(updated),
        f"{changed:,} elements differ from cast(master)",
    )
    same = ids(restored) == ids(updated)
    smoke.check(
        f"{key}/restore_bit_exact",
        not any(bad.values()) and same,
        f"{sum(bad.values())} elements differ; greedy output {'equals' if same else 'differs from'} the "
        "output before the perturbation",
    )
    smoke.check(f"{key}/update_changes_output", ids(updated) != ids(base))
    cos = stats["realised_cos"]
    smoke.check(
        f"{key}/adam_update_realised",
        cos is not None and cos > 0.9 and stats["update_norm"] > 0,
        f"update_norm {stats['update_norm']:.4g}, realised_cos {cos}",
    )

    def iteration():
        for m in members:
            host.perturb(1, m.noise_id, m.sign, args.sigma)
            engine.generate(prompts, greedy, seed=0)
            host.restore()
        host.update(1, members, fitness, args.sigma)

    fig["es_iteration_s"] = smoke.median_s(iteration, args.repeats)
    fig["bare_batched_generation_s"] = smoke.median_s(
        lambda: engine.generate(prompts * len(members), greedy, seed=0), args.repeats
    )
    fig["timing_repeats"] = args.repeats


def max_logit_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """max |a - b| over the real (unpadded) positions of two (rows, seq, vocab) logit tensors."""
    return float((a.float() - b.float()).abs().amax(-1)[mask.bool()].max())


def prompt_logits(engine, enc: dict, factors=None, members: range | None = None) -> torch.Tensor:
    """Teacher-forced logits of the encoded rows: the base model's, or under ``LowRankTerms(factors)`` with the rows
    member-major over ``members``."""
    with torch.no_grad():
        if factors is None:
            return engine.model(**enc).logits.float()
        with LowRankTerms(engine.model, factors) as terms:
            terms.select(members)
            return engine.model(**enc).logits.float()


def check_lowrank(smoke: Smoke, engine, prompts, greedy, args, key: str, fig: dict) -> None:
    """Low-rank population batching. Exact on CPU: every member's greedy completions from one batched generation
    equal that member's alone. On a GPU the bf16 kernels pick tiles by batch shape (docs/engines.md, "Exactness on
    a GPU"), so a member's logits move in their last bits with what shares its batch, and a random model's
    near-tied greedy choices then part: there the check is on teacher-forced logits over the prompts. The base
    model's own batch noise D0 (its rows batched with copies of themselves vs alone) bounds what the hardware does;
    each member's batched logits must equal its alone logits within max(2 D0, Dm / 20), Dm being the smallest gap
    between two members alone (a row given the wrong member's term, or none, moves by about Dm). The greedy
    agreement is reported either way."""
    host = engine.replica_host()
    host.setup(spec(perturbation="lowrank", rank=args.rank))
    members = ask(args.population)
    together = host.generate_members(0, members, args.sigma, prompts, greedy, seed=0)  # also the warm-up
    fig["es_lowrank_generation_s"] = sorted(
        smoke.timed(lambda: host.generate_members(0, members, args.sigma, prompts, greedy, seed=0))[1]
        for _ in range(args.repeats)
    )[args.repeats // 2]
    alone = [host.generate_members(0, [m], args.sigma, prompts, greedy, seed=0)[0] for m in members]
    differ = [m.index for m, a, b in zip(members, together, alone) if ids(a) != ids(b)]
    fig["lowrank_members_differing_alone"] = differ
    distinct = len({tuple(ids(c)) for c in together}) > 1
    enc = engine._encode(prompts)
    k, mask = len(members), enc["attention_mask"]
    batched_enc = {n: v.repeat(k, 1) for n, v in enc.items()}
    base_alone = prompt_logits(engine, enc)
    d0 = max_logit_gap(prompt_logits(engine, batched_enc)[: len(prompts)], base_alone, mask)
    factors = host.replica.member_factors(0, members, args.sigma)
    batched = prompt_logits(engine, batched_enc, factors, range(k)).view(k, len(prompts), *base_alone.shape[1:])
    each = [prompt_logits(engine, enc, host.replica.member_factors(0, [m], args.sigma), range(1)) for m in members]
    d1 = max(max_logit_gap(batched[i], each[i], mask) for i in range(k))
    dm = min(max_logit_gap(each[i], each[j], mask) for i in range(k) for j in range(i + 1, k))
    bound = max(2 * d0, dm / 20)
    fig["lowrank_logits"] = {"base_batch_gap": d0, "batched_vs_alone_gap": d1, "min_member_gap": dm, "bound": bound}
    detail = (
        f"{k} members x {len(prompts)} prompts, rank {args.rank}; greedy differing alone: {differ}; logits: "
        f"batched vs alone {d1:.3g}, base model's batch noise {d0:.3g}, members apart >= {dm:.3g}"
    )
    if smoke.device.type == "cpu":
        smoke.check(f"{key}/lowrank_batched_equals_alone", not differ and distinct and d1 <= bound and dm > 0, detail)
    else:
        smoke.check(f"{key}/lowrank_batched_within_batch_rounding", distinct and dm > 0 and d1 <= bound, detail)
    del batched, each, base_alone
    fitness = shape_fitness([float(i % 3) for i in range(args.population)])
    update_s = smoke.median_s(lambda: host.update(0, members, fitness, args.sigma), args.repeats)
    fig["es_lowrank_iteration_s"] = fig["es_lowrank_generation_s"] + update_s


def time_noise_draws(smoke: Smoke, numel: int) -> dict:
    """Seconds to draw one member's noise for the whole model (``numel`` elements, through one reused fp32 buffer of
    at most 2^27): counter noise eager (the reference loop) and compiled (``noise.compiled_block``), and torch.randn
    (es.noise=per_tensor) beside them; medians of 3 after a warm-up pass."""
    buf = torch.empty(min(numel, 1 << 27), device=smoke.device)
    gen = torch.Generator(device=smoke.device).manual_seed(0)

    def full_pass(draw):
        for off in range(0, numel, buf.numel()):
            draw(off, buf[: min(buf.numel(), numel - off)])

    ways = {
        "counter_eager": lambda o, b: counter_noise(12345, o, b, counter_chunk(smoke.device)),
        "counter_compiled": lambda o, b: counter_noise(12345, o, b),
        "per_tensor_randn": lambda o, b: torch.randn(b.shape, generator=gen, device=b.device, out=b),
    }
    out = {}
    for name, draw in ways.items():
        full_pass(draw)
        out[name] = round(sorted(smoke.timed(lambda: full_pass(draw))[1] for _ in range(3))[1], 4)
    out["eager_over_compiled"] = round(out["counter_eager"] / max(out["counter_compiled"], 1e-9), 2)
    print(
        f"noise {numel:,} elements: counter eager {out['counter_eager']} s, compiled {out['counter_compiled']} s "
        f"({out['eager_over_compiled']}x), randn {out['per_tensor_randn']} s",
        flush=True,
    )
    return out


def check_counter_noise(smoke: Smoke, shape: ModelShape, key: str, fig: dict) -> None:
    """The device's counter noise equals the CPU's bit for bit: a row slice at odd rows of the largest MLP weight
    (``noise_slice``), and a run starting at an odd element offset of odd length (``counter_noise``). On a GPU the
    device draws through the compiled kernel (``noise.compiled_block``; the figures say whether it compiled). On a
    CPU the "device" draws in odd-sized chunks, so the slicing and chunk seams are what is compared."""
    device = smoke.device
    name = "model.layers.0.mlp.down_proj.weight"
    tensor = torch.Size(shape.tensors()[name])
    rows = slice(1, max(2, tensor[0] - 2) | 1)
    chunk = 4099 if device.type == "cpu" else None
    here = NoiseSource(7, "counter", device=str(device), chunk=chunk).noise_slice(3, 5, name, tensor, rows).cpu()
    cpu = NoiseSource(7, "counter", device="cpu").noise(3, 5, name, tensor)[rows]
    start, numel = 8 * 12_345 + 3, 1_000_003 if device.type == "cuda" else 100_003
    seed = derive_seed(7, 3, 5, name)
    a = counter_noise(seed, start, torch.empty(numel, device=device), chunk).cpu()
    b = counter_noise(seed, start, torch.empty(numel))
    same = [torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in ((here, cpu), (a, b))]
    compiled = sorted(d for d, _ in noise._COMPILED if d.startswith(device.type))
    fig["counter_noise"] = {
        "rows": [rows.start, rows.stop],
        "start": start,
        "numel": numel,
        "bit_exact": same,
        "compiled_on": compiled,
        "compile_failed": noise._COMPILE_FAILED.get(device.type),
    }
    fig["noise_draw_s"] = time_noise_draws(smoke, shape.parameters())
    smoke.check(
        f"{key}/counter_noise_device_equals_cpu",
        all(same),
        f"{device.type} vs cpu: rows [{rows.start}, {rows.stop}) of {name} {tuple(tensor)}, "
        f"{numel} elements from offset {start}",
    )


def check_grpo(smoke: Smoke, model_dir: Path, shape: ModelShape, args, key: str, fig: dict) -> None:
    """Two bf16_mixed GRPO steps on random token sequences: loss finite, weights moved, peak memory in the plan."""
    mb, prompt_len, completion_len = args.grpo_micro_batch, args.grpo_prompt_tokens, args.grpo_completion_tokens
    g = GRPOConfig(dtype="bf16_mixed", micro_batch_size=mb, gradient_checkpointing=True, lr=1e-4)
    cfg = GRPOTrainConfig(
        model=ModelConfig(path=str(model_dir)),
        grpo=g,
        sampling=GRPOSamplingConfig(max_new_tokens=completion_len, temperature=1.0),
        engine=GRPOEngineConfig(device=smoke.device.type, threads=torch.get_num_threads()),
    )
    plan = plan_grpo(
        shape,
        Settings(
            learner="bf16_mixed",
            micro_batch_size=mb,
            gradient_checkpointing=True,
            tokens_per_sequence=prompt_len + completion_len,
            completion_tokens=completion_len,
            logit_chunk_tokens=g.logit_chunk_tokens,
        ),
    )
    gen = torch.Generator().manual_seed(1)
    samples = [
        {
            "prompt_ids": torch.randint(0, 256, (prompt_len,), generator=gen).tolist(),
            "completion_ids": torch.randint(0, 256, (completion_len,), generator=gen).tolist(),
        }
        for _ in range(2 * mb)
    ]
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(samples))]
    mem_base = smoke.start_peak()
    learner = GRPOLearner(cfg)
    before = learner.model.get_input_embeddings().weight.detach().clone()
    steps, seconds = smoke.timed(lambda lr=learner: [lr.train_step(samples, advantages) for _ in range(2)])
    measured = smoke.peak_since(mem_base)
    moved = not torch.equal(before, learner.model.get_input_embeddings().weight.detach())
    fig["grpo"] = {
        "loss": [s["grpo/loss"] for s in steps],
        "grad_norm": [s["grpo/grad_norm"] for s in steps],
        "sequences": len(samples),
        "tokens_per_sequence": prompt_len + completion_len,
        "seconds": round(seconds, 3),
    }
    smoke.check(
        f"{key}/grpo_bf16_mixed_two_steps",
        moved and all(s["grpo/loss"] == s["grpo/loss"] and s["grpo/grad_norm"] > 0 for s in steps),
        f"losses {[round(s['grpo/loss'], 4) for s in steps]}, weights moved: {moved}",
    )
    smoke.memory(key, "grpo_learner", measured, plan, "learner", fig)
    # the colocated sync's chunks: the learner's full tensors where it holds them (no host copy); bytes off the device
    chunks = [learner.weight_chunk(k, "bfloat16", on_device=True) for k in range(len(learner.chunks))]
    off = sum(t.nbytes for c in chunks for t in c.values() if t.device.type != smoke.device.type)
    total = sum(t.nbytes for c in chunks for t in c.values())
    fig["colocated_sync"] = {"bytes": total, "host_copy_bytes": off}
    smoke.check(
        f"{key}/colocated_sync_chunks_on_device",
        total > 0 and off == 0,
        f"{total} B of bf16 chunks, {off} B of them on the host",
    )
    del learner, before, chunks


def _host_status(field: str) -> int | None:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM), None off Linux."""
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def check_sharded_learner(
    smoke: Smoke, model_dir: Path, shape: ModelShape, args, key: str, fig: dict, workdir: Path
) -> None:
    """The sharded learner in a world-size-1 group over tcp://127.0.0.1 (NCCL on a GPU, gloo on CPU), FSDP2 with
    grpo.offload=all (a world of one shards only with the offload): its build from the meta device (the host's
    high-water mark and the device's peak against the plan's build lines), a step, a weight-sync chunk through
    full_tensor() and a sharded save and load that gives the same weights back. A world of one runs every collective
    call but exchanges nothing: NCCL across GPUs, and vLLM beside the learner (grpo.colocate), are for a multi-GPU
    machine with vLLM."""
    if dist.is_initialized():
        smoke.check(f"{key}/sharded_learner_world_1", False, "a default process group already exists")
        return
    g = GRPOConfig(dtype="bf16_mixed", micro_batch_size=2, offload="all", lr=1e-4, max_grad_norm=1e-3)  # clipped
    cfg = GRPOTrainConfig(
        model=ModelConfig(path=str(model_dir)),
        grpo=g,
        sampling=GRPOSamplingConfig(max_new_tokens=8, temperature=1.0),
        engine=GRPOEngineConfig(device=smoke.device.type, threads=torch.get_num_threads()),
    )
    plan = plan_grpo(shape, Settings(learner="bf16_mixed", micro_batch_size=2, offload="all"))
    build = {line.item: line.nbytes for line in plan.lines if line.part == "build"}
    learner = GRPOLearner(cfg, 0, 1)
    hwm = Path("/proc/self/clear_refs")
    if hwm.exists():
        hwm.write_text("5")  # the host's high-water mark from here
    host_before, mem_base = _host_status("VmRSS"), smoke.start_peak()
    _, build_s = smoke.timed(lambda lr=learner: lr.join(lr.address()))
    device_peak = smoke.peak_since(mem_base)
    host_rise = None if host_before is None else _host_status("VmHWM") - host_before
    planned_host, planned_device = build["learner build (host)"], build["learner build (device)"]
    try:
        check_group_backends(smoke, learner.group, key, fig)
        gen = torch.Generator().manual_seed(2)
        samples = [
            {
                "prompt_ids": torch.randint(0, 256, (8,), generator=gen).tolist(),
                "completion_ids": torch.randint(0, 256, (8,), generator=gen).tolist(),
            }
            for _ in range(4)
        ]
        step = learner.train_step(samples, [1.0, -1.0, 0.5, -0.5])
        chunk = learner.weight_chunk(1, "bfloat16")
        before = learner.weights()
        learner.save(str(workdir / f"{key}-sharded"), {"step": 1})
        learner.train_step(samples, [1.0, -1.0, 0.5, -0.5])
        learner.load(str(workdir / f"{key}-sharded"))
        after = learner.weights()
    finally:
        learner.close()  # the learner's own group (es_ray/runtime/process_group.py): the default group is never made
    same = all(torch.equal(before[n], after[n]) for n in before)
    fig["sharded_learner"] = {
        "backend": "nccl" if smoke.device.type == "cuda" else "gloo",
        "build_s": round(build_s, 3),
        "build_host_rise_bytes": host_rise,
        "build_device_peak_bytes": device_peak,
        "planned_build_host_bytes": planned_host,
        "planned_build_device_bytes": planned_device,
        "loss": step["grpo/loss"],
        "chunk_tensors": len(chunk),
    }
    fig["sharded_learner"]["grad_norm"] = step["grpo/grad_norm"]
    smoke.check(
        f"{key}/sharded_learner_world_1",
        step["grpo/loss"] == step["grpo/loss"]
        and chunk
        and all(t.dtype == torch.bfloat16 for t in chunk.values())
        and same
        and step["grpo/grad_norm"] > g.max_grad_norm,
        f"{fig['sharded_learner']['backend']}: an offloaded step clipped (grad norm {step['grpo/grad_norm']:.4g} > "
        f"grpo.max_grad_norm={g.max_grad_norm}, loss {step['grpo/loss']:.4g}), a sync chunk of {len(chunk)} "
        f"bf16 tensors through full_tensor, a sharded save and load giving the saved weights back: {same}",
    )
    # the build's host rise holds the host line and, on a CPU rank, the device line too; the whole fp32 model
    # (what a rank held before the meta build) would exceed it
    budget = planned_host + (planned_device if smoke.device.type == "cpu" else 0) + SMOKE_HOST_SLACK
    if host_rise is not None:
        smoke.check(
            f"{key}/sharded_build_host_within_plan",
            host_rise <= budget,
            f"host high-water rise {host_rise / GiB:.3f} GiB <= planned {budget / GiB:.3f} GiB (whole fp32 "
            f"model {shape.parameters() * 4 / GiB:.3f} GiB)",
        )
    if device_peak is not None:
        smoke.check(
            f"{key}/sharded_build_device_within_plan",
            device_peak[1] <= planned_device + ES_SLACK_BYTES,
            f"reserved peak {device_peak[1] / GiB:.3f} GiB <= planned {planned_device / GiB:.3f} GiB + "
            "the allocator slack",
        )
    del learner


def check_group_backends(smoke: Smoke, group, key: str, fig: dict) -> None:
    """The learner's own group carries a backend for the host's tensors beside the device's (gloo beside NCCL on a
    GPU: es_ray.runtime.process_group.backend_kinds): a host tensor and a device tensor each all-reduced on it. With
    grpo.offload=all FSDP2's shards and gradients are on the host, and clip_grad_norm_'s norm and full_tensor() are
    collectives of host tensors (at a world of one DTensor skips them; the group's dispatch by device does not)."""
    host, dev = torch.ones(1), torch.ones(1, device=smoke.device)
    dist.all_reduce(host, group=group.pg)  # "No backend type associated with device type cpu" without gloo
    dist.all_reduce(dev, group=group.pg)
    fig["learner_group_backends"] = dict(group.backends)
    smoke.check(
        f"{key}/learner_group_host_and_device_backends",
        group.backends == backend_kinds(smoke.device.type)
        and "cpu" in group.backends
        and host.item() == 1.0
        and dev.item() == 1.0,
        f"backends {group.backends}: a host and a device all-reduce on the learner's group",
    )


def check_colocated_share(smoke: Smoke, model_dir: Path, shape: ModelShape, key: str, fig: dict) -> None:
    """grpo.colocate=true's share arithmetic on this card: the engine's gpu_memory_utilization (the one the start-up
    check adds, es_ray.memory_plan.engine_share) x the card + the learner's resident lines fit the usable card; on a
    GPU the card is torch.cuda.mem_get_info's total, the share is free now (vLLM refuses to start otherwise), and the
    two are allocated together. On CPU the arithmetic for an 80 GB card (no vLLM, no allocation)."""
    cfg = to_grpo_config(
        {
            "model": {"path": str(model_dir)},
            "engine": {"name": "vllm", "device": "cuda", "max_model_len": 1024},
            "cluster": {"num_actors": 1, "gpus_per_actor": 1},
            "grpo": {
                "colocate": True,
                "dtype": "bf16_mixed",
                "micro_batch_size": 2,
                "prompts_per_step": 2,
                "group_size": 2,
            },
        }
    )
    free = total = None
    if smoke.device.type == "cuda":
        torch.cuda.empty_cache()  # the earlier checks' cached blocks are free to vLLM, not to mem_get_info
        free, total = torch.cuda.mem_get_info(smoke.device)
        props = torch.cuda.get_device_properties(smoke.device)
        reported, name = props.total_memory, props.name
    else:
        reported, name = card_bytes(80), CARD_NAMES[80]
    cfg = planned_engine_config(cfg, reported, name)
    share = cfg.engine.gpu_memory_utilization
    plan = plan_for("grpo", cfg, shape, reported, name)
    mapped, resident = int(share * reported), plan.learner_resident
    ok = (
        0 < share <= 1
        and plan.part("vllm") <= mapped
        and mapped + resident <= usable_bytes(reported)
        and plan.total >= mapped + resident
    )
    if total is not None:
        ok = ok and total == reported and free >= mapped
        blob = torch.empty(mapped + resident, dtype=torch.uint8, device=smoke.device)  # both on the card at once
        del blob
        torch.cuda.empty_cache()
    fig["colocated_share"] = {
        "share": share,
        "card_bytes": reported,
        "mem_get_info": [free, total],
        "vllm_mapped_bytes": mapped,
        "learner_resident_bytes": resident,
        "usable_bytes": usable_bytes(reported),
        "plan_total_bytes": plan.total,
    }
    smoke.check(
        f"{key}/colocated_share_fits",
        ok,
        f"engine share {share:.2f} x {reported / GiB:.1f} GiB = {mapped / GiB:.2f} GiB + learner resident "
        f"{resident / GiB:.2f} GiB <= usable {usable_bytes(reported) / GiB:.2f} GiB"
        + (f"; free now {free / GiB:.2f} GiB" if free is not None else ""),
    )


def run_model(smoke: Smoke, name: str, fields: dict, args, workdir: Path) -> dict:
    device, key = smoke.device, name
    shape = ModelShape.from_hf_config(fields, name=name)
    fig: dict = {"parameters": shape.parameters()}
    print(f"== {name}: {shape.parameters():,} parameters on {device}", flush=True)
    model_dir = workdir / name
    _, fig["build_s"] = smoke.timed(lambda: build_model_dir(fields, device, args.seed, model_dir))
    engine_cfg = EngineConfig(
        name="hf", device=device.type, batch_size=len(PROMPTS) * args.population, threads=torch.get_num_threads()
    )
    engine, fig["load_s"] = smoke.timed(lambda: HFEngine(str(model_dir), engine_cfg))
    prompts = list(PROMPTS[: args.prompts])
    greedy = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    base = check_engine(smoke, engine, prompts, greedy, key, fig)
    check_full_rank(smoke, engine, shape, prompts, greedy, base, args, key, fig)
    check_lowrank(smoke, engine, prompts, greedy, args, key, fig)
    engine.close()
    del engine
    check_counter_noise(smoke, shape, key, fig)
    check_grpo(smoke, model_dir, shape, args, key, fig)
    check_sharded_learner(smoke, model_dir, shape, args, key, fig, workdir)
    check_colocated_share(smoke, model_dir, shape, key, fig)
    fig["es_iteration_over_bare_generation"] = round(fig["es_iteration_s"] / fig["bare_batched_generation_s"], 3)
    fig["es_lowrank_iteration_over_bare_generation"] = round(
        fig["es_lowrank_iteration_s"] / fig["bare_batched_generation_s"], 3
    )
    for k in (
        "es_iteration_s",
        "bare_batched_generation_s",
        "es_lowrank_generation_s",
        "es_lowrank_iteration_s",
        "build_s",
        "load_s",
    ):
        fig[k] = round(fig[k], 3)
    print(
        f"timings {name}: ES iteration {fig['es_iteration_s']} s (full rank), {fig['es_lowrank_iteration_s']} s "
        f"(low rank), bare batched generation of the same rows {fig['bare_batched_generation_s']} s",
        flush=True,
    )
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="one tiny Qwen2-shaped model instead of 0.5B and 1.5B")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts per member (at most {len(PROMPTS)})")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per prompt (32; --tiny: 8)")
    ap.add_argument("--sigma", type=float, default=1e-2)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per timing after a warm-up (median; >= 3)")
    ap.add_argument("--rank", type=int, default=4, help="es.rank of the low-rank check")
    ap.add_argument("--grpo-micro-batch", type=int, default=None, help="GRPO micro-batch (4; --tiny: 2)")
    ap.add_argument("--grpo-prompt-tokens", type=int, default=None, help="(64; --tiny: 8)")
    ap.add_argument("--grpo-completion-tokens", type=int, default=None, help="(192; --tiny: 8)")
    args = ap.parse_args(argv)
    for field, full, tiny in (
        ("max_new_tokens", 32, 8),
        ("grpo_micro_batch", 4, 2),
        ("grpo_prompt_tokens", 64, 8),
        ("grpo_completion_tokens", 192, 8),
    ):
        if getattr(args, field) is None:
            setattr(args, field, tiny if args.tiny else full)
    if args.repeats < 3:
        ap.error(f"--repeats={args.repeats}: a median needs at least 3 timed runs; set --repeats=3 or more")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda}): run with --device cpu --tiny",
            file=sys.stderr,
        )
        return 2
    smoke = Smoke(device)
    figures: dict = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda, "models": {}}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        figures.update(gpu=props.name, sm_count=props.multi_processor_count, gpu_total_bytes=props.total_memory)
    else:
        figures.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        for name, fields in (TINY if args.tiny else MODELS).items():
            figures["models"][name] = run_model(smoke, name, fields, args, Path(tmp))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    figures["checks"] = smoke.checks
    figures["wall_s"] = round(time.perf_counter() - t0, 3)
    figures["ok"] = bool(smoke.checks) and all(smoke.checks.values())
    failed = [k for k, v in smoke.checks.items() if not v]
    figures["unconfirmed_here"] = UNCONFIRMED
    print("only a multi-GPU machine with vLLM confirms: " + "; ".join(UNCONFIRMED))
    print(f"{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)} in {figures['wall_s']:.1f} s")
    print(json.dumps(figures, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
