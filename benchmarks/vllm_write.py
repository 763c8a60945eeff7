"""Where one full-rank ES write into vLLM's CPU build goes, and what the alternative GEMM would cost, in one run.

    python benchmarks/vllm_write.py                      # the embedded SmolLM2-135M, 6 perturbations + a restore
    python benchmarks/vllm_write.py --writes 3 --threads 1

(1) A write, split: an ``es_ray.es.worker.ESWorker`` with engine.name=vllm (in-process, one thread as one demo
    actor has) perturbs the replica ``--writes`` times and restores it once; the extension's write is timed in
    its parts: the replica's generator (noise drawn and added to the master, into a reused buffer), vLLM's
    ``load_weights`` (copies into the fused tensors), and the post-load step (``process_weights_after_loading``:
    on CPU, oneDNN repacks every touched linear layer), the latter per layer kind as well.
(2) The packed GEMM against ``F.linear`` on the unpacked weight, for every linear shape of the model, at a decode
    batch (M = 16) and a prefill-sized one (M = 128): what skipping the repack would cost in generation.

The last line is one JSON object: write_<part>_s (medians), repack_<layer kind>_s,
gemm_<N>x<K>_m<M>_flinear_over_onednn, pack_<N>x<K>_s, and the settings.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

# torch and the modules under test are imported in the functions that run them: --help needs none of them.


def timed_write(times: dict, seen: dict):
    """The extension's ``_es_write`` (same steps, same order) with a clock around each part; ``seen["model"]``:
    vLLM's model (the worker runs in this process)."""
    import torch

    from es_ray.engines import vllm_extension as vx

    def write(self, named) -> None:
        model = seen["model"] = self.model_runner.get_model()
        layer_map = self._es_post_load_layers(model)
        gen = [0.0]

        def clocked(it):
            it = iter(it)
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    gen[0] += time.perf_counter() - t0
                    return
                gen[0] += time.perf_counter() - t0
                yield item

        t0 = time.perf_counter()
        with torch.no_grad():
            loaded = model.load_weights(clocked(named))
            t1 = time.perf_counter()
            params = {vx._plain(n): p for n, p in model.named_parameters(remove_duplicate=False)}
            touched = {id(layer): layer for n in loaded if n in params for layer in layer_map.get(id(params[n]), ())}
            per = collections.defaultdict(float)
            for layer in touched.values():
                a = time.perf_counter()
                layer.quant_method.process_weights_after_loading(layer)
                per[f"{type(layer).__name__}_{'x'.join(map(str, layer.weight.shape))}"] += time.perf_counter() - a
            t2 = time.perf_counter()
        for key, value in (
            ("noise_and_add", gen[0]),
            ("load_weights", t1 - t0 - gen[0]),
            ("repack", t2 - t1),
            ("total", t2 - t0),
        ):
            times[key].append(value)
        for key, value in per.items():
            times[f"repack_{key}"].append(value)

    return write


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="model.path (empty: the embedded SmolLM2-135M)")
    ap.add_argument("--writes", type=int, default=6, help="perturbations timed (then one restore)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gemm-repeats", type=int, default=30)
    args = ap.parse_args()

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import population
    from engines import _median_time

    def median_time(fn, repeats: int) -> float:
        fn()  # warm-up
        return _median_time(fn, repeats)

    from es_ray.engines import vllm_extension as vx
    from es_ray.es.worker import ESWorker

    times: dict[str, list[float]] = collections.defaultdict(list)
    seen: dict = {}
    vx.ESExtension._es_write = timed_write(times, seen)
    settings = argparse.Namespace(
        model=args.model,
        members=max(2, args.writes),
        prompts=16,
        max_new_tokens=4,
        threads=args.threads,
        rank=8,
        repeats=1,
        vllm_compiled=False,
    )
    worker = ESWorker(population.build_config(settings, "vllm", "full"))
    times.clear()  # the setup's own write
    for member in range(args.writes):
        worker.replica.perturb(1, member, 1, 5e-3)
    worker.replica.restore()
    out = {f"write_{k}_s" if not k.startswith("repack_") else f"{k}_s": statistics.median(v) for k, v in times.items()}
    print("one write (median over the perturbations and the restore):")
    for key, value in out.items():
        print(f"  {key:60s} {value:.4f}")

    from vllm import _custom_ops as ops

    torch.set_num_threads(args.threads)
    shapes = sorted(
        {
            tuple(m.weight.shape)
            for m in seen["model"].modules()
            if getattr(m, "quant_method", None) is not None
            and getattr(m, "weight", None) is not None
            and m.weight.dim() == 2
            and m.weight.numel()
        },
        reverse=True,
    )
    print("packed oneDNN GEMM vs F.linear on the unpacked weight (ms):")
    for n, k in shapes:
        w = torch.randn(n, k)
        handler = ops.create_onednn_mm(w.t(), 32)
        out[f"pack_{n}x{k}_s"] = median_time(lambda: ops.create_onednn_mm(w.t(), 32), 5)
        for m in (16, 128):
            x = torch.randn(m, k)
            packed = median_time(lambda: ops.onednn_mm(handler, x, None), args.gemm_repeats)
            plain = median_time(lambda: torch.nn.functional.linear(x, w), args.gemm_repeats)
            out[f"gemm_{n}x{k}_m{m}_flinear_over_onednn"] = plain / packed
            print(
                f"  {n}x{k} M={m}: oneDNN {packed * 1e3:.3f}  F.linear {plain * 1e3:.3f}  ratio {plain / packed:.2f}"
                f"  (pack {out[f'pack_{n}x{k}_s'] * 1e3:.1f})"
            )
    worker.engine.close()
    out.update(model=args.model or "embedded SmolLM2-135M-Instruct", writes=args.writes, threads=args.threads)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
