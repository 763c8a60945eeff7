"""GPU smoke test of the ES replica at the paper's scale, with torch and transformers only (no vLLM, no Ray).

    python scripts/gpu_smoke.py                     # a Llama-3.1-8B-shaped model, bf16, CUDA: ~2-4 min on one H200
    python scripts/gpu_smoke.py --tiny --device cpu # the same checks on a small config (CI, seconds)

Builds a randomly initialised Llama-shaped model (on the meta device, then ``to_empty`` and seeded randn in
chunks: no init kernels, no 32 GB fp32 copy), puts an ES replica (``es_ray.replica.Replica``, a write/read pair
over ``named_parameters``) beside it, and checks, exiting 1 if any fails:

* memory: the plan (``es_ray.memory_plan``: engine weights + the replica's ES part) against
  ``torch.cuda.max_memory_allocated()`` after setup and after an Adam update; the plan must not be exceeded;
* exact restore: after perturb -> restore every engine tensor equals cast(master) bit for bit;
* the Adam update: realised in the engine (cos(realised, intended) > 0.9), optimizer state fp32 on the device;
* a state_dict round trip: ``torch.save`` to a temporary directory, ``torch.load(map_location="cpu")``,
  ``load_state_dict`` into the replica: master and Adam moments back on the device in fp32, equal to what was saved
  (at 8B on a subset of tensors, ``--roundtrip-trainable``: the whole state would be 96 GB on disk);
* noise: a per-tensor randn checksum per tensor, printed with the GPU's name and SM count (CUDA's generator sizes
  its launch grid from the SM count, so the numbers are per GPU model); where es_ray.noise has ``counter``, counter
  noise on the device must equal the same noise drawn on the CPU bit for bit.

The last line of the output is one JSON object with every figure (``ok`` says whether every check passed).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a bare checkout (no install)

from es_ray.memory_plan import GiB, LLAMA_3_1_8B, ModelShape, Settings, plan_es  # noqa: E402
from es_ray.noise import NOISE_KINDS, NoiseSource  # noqa: E402
from es_ray.replica import Replica, ReplicaSpec, mismatches, tensor_checksum  # noqa: E402
from es_ray.strategy import ask, shape_fitness  # noqa: E402

TINY = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, vocab_size=1024, tie_word_embeddings=False, max_position_embeddings=512)
FILL_CHUNK = 1 << 26
"""Elements per randn draw while filling the weights (a 256 MB fp32 temporary at most)."""
NOISE_TENSORS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.0.input_layernorm.weight")
"""The tensors whose per_tensor noise is checksummed; the last three (8.4M elements at 8B) are also drawn as counter
noise on the device and on the CPU, whose draw takes about a microsecond per element on one core."""


def build_model(fields: dict, device: torch.device, seed: int) -> torch.nn.Module:
    """Random bf16 weights, std 0.02, each tensor from its own seeded generator (the same model on every run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in fields.items() if k != "hub"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.to_empty(device=device)  # uninitialised; rotary buffers too, which nothing here uses (no forward pass)
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for i, (_, p) in enumerate(sorted(model.named_parameters())):
            gen.manual_seed(seed * 1_000_003 + i)
            flat = p.view(-1)
            for a in range(0, flat.numel(), FILL_CHUNK):
                part = flat[a : a + FILL_CHUNK]
                part.copy_(torch.randn(part.shape, generator=gen, device=device).mul_(0.02))
    return model


def spec(**changes) -> ReplicaSpec:
    base = dict(run_seed=0, noise="per_tensor", noise_table_size=1 << 20, noise_scope="per_tensor", trainable="",
                optimizer="adam", lr=1e-3,
                adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0, anchor_decay=0.0,
                perturbation="full", rank=8)
    return ReplicaSpec(**{**base, **changes})


def bit_mismatches(replica: Replica, read) -> int:
    """Elements where the engine's bits differ from cast(master)'s (compared as integers: -0.0 != 0.0 here)."""
    bad = 0
    for name in replica.names:
        held = read(name)
        cast = replica.master[name].to(held.dtype)
        ints = torch.int16 if held.element_size() == 2 else torch.int32
        bad += int((cast.view(ints) != held.view(ints)).sum())
    return bad


class Smoke:
    def __init__(self, device: torch.device):
        self.device = device
        self.figures: dict = {"checks": {}}

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.figures["checks"][name] = bool(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()


def memory_figures(smoke: Smoke, plan, stage: str, items: tuple[str, ...]) -> None:
    """Planned bytes for the engine weights and the replica lines ``items`` (no vLLM here: its other lines are left
    out) against torch's peak allocation; the plan must hold the measurement."""
    planned = sum(line.nbytes for line in plan.lines if line.item in items)
    measured = smoke.peak()
    smoke.figures[f"plan_{stage}_bytes"] = planned
    smoke.figures[f"measured_{stage}_bytes"] = measured
    print(f"memory after {stage}: planned {planned / GiB:.2f} GiB ({', '.join(items)}), "
          f"max_memory_allocated {'n/a (cpu)' if measured is None else f'{measured / GiB:.2f} GiB'}")
    if measured is not None:
        smoke.check(f"memory_{stage}_within_plan", measured <= planned,
                    f"{measured / GiB:.2f} <= {planned / GiB:.2f} GiB")


def noise_figures(smoke: Smoke, shapes: dict[str, tuple[int, ...]]) -> None:
    source = NoiseSource(7, "per_tensor", device=smoke.device)
    smoke.figures["randn_checksums"] = {name: tensor_checksum(source.noise(0, 0, name, torch.Size(shapes[name])))
                                        for name in NOISE_TENSORS}
    print("per_tensor randn checksums:", json.dumps(smoke.figures["randn_checksums"]))
    if "counter" not in NOISE_KINDS:
        smoke.figures["counter"] = None
        print("es.noise=counter not in es_ray.noise.NOISE_KINDS: counter comparison skipped")
        return
    here, cpu = NoiseSource(7, "counter", device=smoke.device), NoiseSource(7, "counter", device="cpu")
    result = {}
    for name in NOISE_TENSORS[2:]:
        a, b = here.noise(0, 0, name, torch.Size(shapes[name])).cpu(), cpu.noise(0, 0, name, torch.Size(shapes[name]))
        result[name] = {"bit_exact": torch.equal(a.view(torch.int32), b.view(torch.int32)),
                        "max_abs_diff": float((a - b).abs().max()) if a.numel() else 0.0,
                        "checksum": tensor_checksum(a)}
    smoke.figures["counter"] = result
    smoke.check("counter_noise_device_equals_cpu", all(r["bit_exact"] for r in result.values()),
                f"{smoke.device.type} vs cpu on {len(result)} tensors")


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    smoke = Smoke(device)
    fields = TINY if args.tiny else LLAMA_3_1_8B
    shape = ModelShape.from_hf_config(fields, name="tiny-llama" if args.tiny else "llama3.1-8b-shaped")
    fig, timings = smoke.figures, {}
    fig.update(model=shape.name, parameters=shape.parameters(), device=str(device), torch=torch.__version__,
               cuda=torch.version.cuda)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        fig.update(gpu=props.name, sm_count=props.multi_processor_count, gpu_total_bytes=props.total_memory)
    else:
        fig.update(gpu=None, sm_count=None, cpu=platform.processor() or platform.machine())
    print(f"{shape.name}: {shape.parameters():,} parameters on {fig.get('gpu') or device} "
          f"(SMs {fig.get('sm_count')}), torch {torch.__version__}", flush=True)

    plan = plan_es(shape, Settings(optimizer="adam", noise="per_tensor", trainable=args.trainable))
    print(plan.markdown(), flush=True)
    fig["plan"] = {line.item: line.nbytes for line in plan.lines}

    t0 = time.perf_counter()
    model = build_model(fields, device, args.seed)
    params = dict(model.named_parameters())
    smoke.check("tensors_equal_plan", {n: tuple(p.shape) for n, p in params.items()} == shape.tensors())

    @torch.no_grad()
    def write(named):
        for name, t in named:
            params[name].copy_(t)

    def read(name):
        return params[name].detach()

    smoke.sync()
    timings["build_s"] = time.perf_counter() - t0
    smoke.reset_peak()  # from here: the engine's weights (held) plus what the replica allocates

    t0 = time.perf_counter()
    replica = Replica(params.items(), spec(trainable=args.trainable), write, read, device)
    smoke.sync()
    timings["replica_s"] = time.perf_counter() - t0
    memory_figures(smoke, plan, "setup", ("engine weights", "fp32 master", "_buf", "_nbuf", "allocator slack"))

    t0 = time.perf_counter()
    replica.perturb(0, 0, 1, args.sigma)
    changed = sum(mismatches(replica.master[n], read(n)) for n in replica.names)
    replica.restore()
    smoke.sync()
    timings["perturb_restore_s"] = time.perf_counter() - t0
    bad = bit_mismatches(replica, read)
    fig.update(perturb_changed_elements=changed, restore_bit_mismatches=bad)
    smoke.check("perturb_changes_the_engine", changed > 0, f"{changed:,} elements")
    smoke.check("restore_is_bit_exact", bad == 0, f"{bad} elements differ from cast(master)")

    members = ask(args.population)
    fitness = shape_fitness([float(i % 3) for i in range(args.population)])
    smoke.reset_peak()
    t0 = time.perf_counter()
    stats = replica.update(0, members, fitness, args.sigma)  # raises if the engine does not hold cast(master)
    smoke.sync()
    timings["update_s"] = time.perf_counter() - t0
    fig["update"] = stats
    memory_figures(smoke, plan, "update", ("engine weights", "fp32 master", "_buf", "_nbuf", "Adam moments",
                                            "step temporary", "update chunks", "allocator slack"))
    cos = stats["realised_cos"]
    smoke.check("adam_update_is_realised", cos is not None and cos > 0.9 and stats["update_norm"] > 0,
                f"update_norm {stats['update_norm']:.4g}, realised_cos {cos}")
    moments = [t for st in replica.opt.state.values() for t in st.values()]
    smoke.check("adam_state_fp32_on_device", len(replica.opt.state) == len(replica.names) and all(
        t.device.type == device.type and t.dtype == torch.float32 for t in moments))

    del replica, moments
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    roundtrip(smoke, params, write, read, args)
    timings["roundtrip_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    noise_figures(smoke, shape.tensors())
    timings["noise_s"] = time.perf_counter() - t0
    fig["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    fig["ok"] = all(fig["checks"].values())
    return fig


def roundtrip(smoke: Smoke, params: dict, write, read, args: argparse.Namespace) -> None:
    """Update (so Adam has state), save, change the state by another update, load the saved one back: it must land
    on the device in fp32 and equal what was saved, and the engine must hold cast(master) again."""
    device = smoke.device
    trainable = "" if args.tiny else args.roundtrip_trainable
    replica = Replica(params.items(), spec(trainable=trainable), write, read, device)
    members, fitness = ask(args.population), shape_fitness([float(i) for i in range(args.population)])
    replica.update(1, members, fitness, args.sigma)
    saved_checksum = replica.checksum()
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        path = Path(tmp) / "replica.pt"
        torch.save(replica.state_dict(), path)
        size = path.stat().st_size
        loaded = torch.load(path, map_location="cpu", weights_only=False)
    replica.update(2, members, fitness, args.sigma)
    moved = replica.checksum() != saved_checksum
    replica.load_state_dict(loaded)
    tensors = [*replica.master.values(), *(t for st in replica.opt.state.values() for t in st.values())]
    equal = replica.checksum() == saved_checksum and replica.opt.t == loaded["optimizer"]["t"] and all(
        torch.equal(t.cpu(), loaded["optimizer"]["state"][n][k]) for n, st in replica.opt.state.items()
        for k, t in st.items())
    smoke.figures["roundtrip"] = {"trainable": trainable, "tensors": len(replica.names), "file_bytes": size,
                                  "state_changed_before_load": moved}
    smoke.check("roundtrip_restores_state", moved and equal, f"{len(replica.names)} tensors, {size / GiB:.2f} GiB file")
    smoke.check("roundtrip_lands_on_device_fp32", all(t.device.type == device.type and t.dtype == torch.float32
                                                      for t in tensors))
    smoke.check("roundtrip_engine_holds_master", bit_mismatches(replica, read) == 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small Llama config instead of Llama-3.1-8B's")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--population", type=int, default=4)
    ap.add_argument("--sigma", type=float, default=1e-3)
    ap.add_argument("--trainable", default="", help="model.trainable of the main replica (empty: every tensor)")
    ap.add_argument("--roundtrip-trainable", default=r"model\.layers\.0\.",
                    help="model.trainable of the save/load round trip at full size (--tiny: every tensor)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (and --tiny)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    figures = run(args)
    figures["wall_s"] = round(time.perf_counter() - t0, 3)
    failed = [k for k, v in figures["checks"].items() if not v]
    print(f"{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)} in {figures['wall_s']:.1f} s")
    print(json.dumps(figures, default=str))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
