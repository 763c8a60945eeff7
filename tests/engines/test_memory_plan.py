"""es_ray.memory_plan: tensor counts against transformers' own models (meta device), the KV-cache and optimizer
arithmetic, the refusals, the vLLM engine's wiring (without vLLM or a GPU), the CLI and the README's table."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from es_ray.memory_plan import (
    GiB,
    LEARNER_VARIANTS,
    LLAMA_3_1_8B,
    LOGIT_COPIES,
    PRESETS,
    ModelShape,
    Settings,
    auto_gpu_memory_utilization,
    plan_es,
    plan_grpo,
    preset,
    vllm_batch_defaults,
)
from paths import REPO


def meta_shapes(cfg) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def hf_config(fields: dict):
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if k != "hub"}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


SMALL = {
    "llama": dict(
        model_type="llama",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=300,
        tie_word_embeddings=False,
    ),
    "llama_bias_headdim": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        vocab_size=200,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
    ),
    "qwen2_untied": dict(
        model_type="qwen2",
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        vocab_size=128,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_tensors_equal_a_transformers_model_of_the_same_config(name):
    cfg = hf_config(SMALL[name])
    shape = ModelShape.from_hf_config(cfg.to_dict(), name=name)
    want = meta_shapes(cfg)
    assert shape.tensors() == want
    assert shape.parameters() == sum(torch.Size(s).numel() for s in want.values())


def test_tensors_equal_the_embedded_smollm2_and_its_published_size():
    from transformers import AutoConfig

    from es_ray.models import resolve_model

    model_dir = resolve_model("")
    shape = ModelShape.from_dir(model_dir)
    assert shape.tensors() == meta_shapes(AutoConfig.from_pretrained(model_dir))
    assert shape.parameters() == 134_515_008  # SmolLM2-135M, tied embedding


@pytest.mark.parametrize("name", [*PRESETS, "llama3.1-8b"])
def test_presets_equal_transformers_models_and_the_published_sizes(name):
    published = {
        "qwen2.5-1.5b": 1_543_714_304,
        "llama3.2-3b": 3_212_749_824,
        "qwen2.5-7b": 7_615_616_512,
        "r1-distill-qwen-1.5b": 1_777_088_000,
        "llama3.1-8b": 8_030_261_248,
    }
    fields = LLAMA_3_1_8B if name == "llama3.1-8b" else PRESETS[name]
    shape = ModelShape.from_hf_config(fields, name=name)
    assert shape.tensors() == meta_shapes(hf_config(fields))
    assert shape.parameters() == published[name]


def test_presets_are_the_conf_model_presets():
    confs = {p.stem: yaml.safe_load(p.read_text())["path"] for p in (REPO / "conf" / "model").glob("*.yaml")}
    confs.pop("smollm2-135m")  # the embedded CPU default, not one of the paper's models
    assert confs == {name: fields["hub"] for name, fields in PRESETS.items()}


def test_kv_cache_is_two_x_layers_x_kv_heads_x_head_dim_x_dtype_per_token():
    m = preset("qwen2.5-7b")  # 28 layers, 4 KV heads of 128
    assert m.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2 == 57_344
    plan = plan_es(m, Settings(sequences=32, tokens_per_sequence=1024))
    assert plan.item_bytes("vllm", "KV cache") == 32 * 1024 * 57_344
    tp2 = plan.with_settings(tensor_parallel_size=2)  # the KV heads split over the ranks
    assert tp2.item_bytes("vllm", "KV cache") == 32 * 1024 * 57_344 // 2
    llama = preset("llama3.2-3b")  # 28 layers, 8 KV heads of 128, fp32 engine
    assert llama.kv_bytes_per_token(4) == 2 * 28 * 8 * 128 * 4


def test_es_part_counts_master_adam_anchor_and_buffers_exactly():
    m = preset("qwen2.5-1.5b")
    n, big = m.parameters(), 151_936 * 1536  # the (tied) embedding is the largest tensor
    sgd, adam = plan_es(m, Settings(noise="per_tensor")), plan_es(m, Settings(optimizer="adam", noise="per_tensor"))
    assert sgd.item_bytes("es", "fp32 master") == 4 * n
    assert sgd.item_bytes("es", "write buffer") == sgd.item_bytes("es", "noise buffer") == 4 * big
    assert adam.item_bytes("es", "Adam") == 8 * n  # Adam adds exactly 8 B per parameter ...
    assert adam.part("es") - sgd.part("es") == 8 * n + 4 * big  # ... plus its one largest-tensor temporary
    anchored = plan_es(m, Settings(optimizer="adam", noise="per_tensor", anchor_decay=0.1))
    assert anchored.part("es") - adam.part("es") == 4 * n
    table = plan_es(m, Settings(noise="table", noise_table_size=1 << 28))
    assert table.part("es") - sgd.part("es") == 4 * (1 << 28) - 4 * big  # the table instead of the noise buffer
    counter = plan_es(m, Settings(noise="counter"))
    assert counter.part("es") - sgd.part("es") == counter.item_bytes("es", "counter noise") > 0
    assert plan_es(m).part("es") == counter.part("es")  # auto on GPU: planned as the larger of per_tensor, counter
    layer0 = plan_es(m, Settings(trainable=r"layers\.0\."))
    assert layer0.item_bytes("es", "fp32 master") == 4 * m.parameters(r"layers\.0\.") < 4 * n // 20


def test_tensor_parallel_ranks_keep_their_shards():
    m = ModelShape.from_hf_config(SMALL["qwen2"])  # h 64, I 112, 4 heads and 2 KV heads of 16, vocab 256, tied
    plan = plan_es(m, Settings(tensor_parallel_size=4, optimizer="adam", noise="counter"))
    # per layer at TP 4: q 16 rows (+16 bias); k and v one KV head each (replicated: 2 heads < 4 ranks), 16 rows
    # (+16 bias); o_proj 16 of 64 columns; gate and up 28 of 112 rows; down_proj 28 of 112 columns; both norms whole
    layer = 16 * 64 + 16 + 2 * (16 * 64 + 16) + 64 * 16 + 2 * 28 * 64 + 64 * 28 + 2 * 64
    shard = 2 * layer + 64 * 64 + 64  # + a quarter of the vocabulary rows + the final norm
    assert plan.item_bytes("es", "fp32 master") == 4 * shard and plan.item_bytes("es", "Adam") == 8 * shard
    assert plan.item_bytes("es", "write buffer") == 4 * 256 * 64  # a sharded write hands vLLM the whole HF tensor
    assert plan.item_bytes("es", "noise buffer") == 4 * 64 * 112  # counter: a part's rows; down_proj's columns whole
    whole = plan_es(m, Settings(tensor_parallel_size=4, optimizer="adam", noise="counter", master_sharded=False))
    assert whole.item_bytes("es", "fp32 master") == 4 * m.parameters()
    big = preset("qwen2.5-7b")
    one, four = plan_es(big), plan_es(big, Settings(tensor_parallel_size=4))
    assert four.item_bytes("vllm", "engine weights") == one.item_bytes("vllm", "engine weights") // 4
    assert four.item_bytes("es", "fp32 master") == pytest.approx(one.item_bytes("es", "fp32 master") / 4, rel=0.01)


def test_auto_noise_is_planned_as_the_larger_of_the_gpu_kinds():
    import es_ray.noise as noise

    m = preset("qwen2.5-7b")
    for tp in (1, 4):
        auto = plan_es(m, Settings(tensor_parallel_size=tp)).part("es")
        assert auto >= max(
            plan_es(m, Settings(tensor_parallel_size=tp, noise=k)).part("es") for k in ("per_tensor", "counter")
        )
    if hasattr(noise, "resolve_kind"):
        assert noise.resolve_kind("auto", "cuda") in ("per_tensor", "counter")


def test_grpo_learner_variants_and_the_logits_chunk():
    m = preset("qwen2.5-7b")
    n = m.parameters()
    for variant in LEARNER_VARIANTS:  # every precision holds 16 B per trainable parameter
        plan = plan_grpo(m, Settings(learner=variant))
        assert (
            sum(
                line.nbytes
                for line in plan.lines
                if line.item in ("weights", "gradients", "fp32 master", "AdamW moments")
            )
            == 16 * n
        ), variant
    assert 16 * n / 1e9 == pytest.approx(122, abs=0.5)  # the "about 122 GB" for fp32 + grads + AdamW
    assert (
        plan_grpo(m, Settings(micro_batch_size=4, completion_tokens=512)).item_bytes("learner", "logits")
        == 1024 * 152_064 * 4 * LOGIT_COPIES
    )  # grpo.logit_chunk_tokens positions at once, not 4 x 512
    assert (
        plan_grpo(m, Settings(micro_batch_size=2, completion_tokens=256)).item_bytes("learner", "logits")
        == 512 * 152_064 * 4 * LOGIT_COPIES
    )
    plan = plan_grpo(m)
    assert not plan.fits(80 * GiB) and plan.fits(141 * GiB)  # an H200 holds the 7B learner
    assert "grpo.gradient_checkpointing" in plan.refusal(80 * GiB)


def test_a_7b_plan_does_not_fit_24gb_and_says_what_to_change():
    plan = plan_es(preset("qwen2.5-7b"), Settings(optimizer="adam"))
    assert not plan.fits(24 * GiB) and plan.tp_needed(24 * GiB) is None
    msg = plan.refusal(24 * GiB)
    for key in (
        "engine.gpu_memory_utilization",
        "es.optimizer=sgd",
        "engine.tensor_parallel_size",
        "a GPU with at least",
        "Adam moments 56.7 GiB",
        "fp32 master 28.4 GiB",
    ):
        assert key in msg, key
    assert plan.refusal(200 * GiB) is None


def test_a_measured_refusal_offers_the_share_that_leaves_room():
    plan = plan_es(preset("qwen2.5-7b"))  # sgd: ~33 GiB beside vLLM
    msg = plan.refusal(80 * GiB, free_bytes=30 * GiB, share=0.6)
    assert "engine.gpu_memory_utilization=0.58" in msg and "30.0 GiB are free" in msg
    assert plan.refusal(80 * GiB, free_bytes=40 * GiB, share=0.4) is None


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("card_gb", [40, 80, 141])
def test_the_automatic_share_leaves_room_for_every_es_setting_that_fits(name, card_gb):
    m, card = preset(name), card_gb * GiB
    s = Settings(sequences=1, tokens_per_sequence=4096, **vllm_batch_defaults(card))
    share = auto_gpu_memory_utilization(m, card, s)
    assert plan_es(m, s).gpu_memory_utilization(card) <= share <= 0.9
    for es in ({"optimizer": "sgd"}, {"optimizer": "adam"}):
        plan = plan_es(m, replace(s, **es))
        if plan.fits(card):
            assert share * card + plan.part("es") <= card, es


# -- the vLLM engine's wiring, without vLLM or a GPU ---------------------------------------------------------


def fake_engine(tmp_path, share: float, **cfg):
    from es_ray.core.config import EngineConfig
    from es_ray.engines.vllm import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen2.5-1.5b"]))
    engine = types.SimpleNamespace(
        model_dir=str(tmp_path),
        cfg=EngineConfig(name="vllm", **cfg),
        dtype=torch.bfloat16,
        _gpu_share=share,
        device="cuda",
        _weights_changed=lambda: None,
        lowrank=None,
        _reset_prefix_cache=lambda: None,
    )
    engine._plan_settings = lambda **es: VLLMEngine._plan_settings(engine, **es)
    engine.check_es_memory = lambda spec: VLLMEngine.check_es_memory(engine, spec)
    return engine, VLLMEngine


def replica_spec(**changes):
    from es_ray.replica import ReplicaSpec

    base = dict(
        run_seed=0,
        noise="auto",
        noise_table_size=1 << 25,
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
        rank=8,
    )
    return ReplicaSpec(**{**base, **changes})


def test_the_replica_host_refuses_before_setup_when_the_gpu_is_too_full(tmp_path, monkeypatch):
    from es_ray.core.config import ConfigError
    from es_ray.engines.vllm import VLLMReplicaHost
    from es_ray.engines.vllm_extension import ESExtension

    engine, _ = fake_engine(tmp_path, share=0.7, max_model_len=2048)
    calls = []
    # every vLLM worker measures its own device (es_device_memory): 10 GiB free of 40
    engine._rpc = lambda method, *args: (
        [(10 * GiB, 40 * GiB)] if method is ESExtension.es_device_memory else calls.append(method)
    )
    host = VLLMReplicaHost(engine)
    with pytest.raises(ConfigError) as err:  # adam on 1.5B: ~21 GiB beside vLLM, 10 free
        host.setup(replica_spec())
    assert "engine.gpu_memory_utilization=0." in str(err.value) and "es.optimizer=sgd (fits)" in str(err.value)
    assert calls == []  # refused before the replica was built
    host.setup(replica_spec(optimizer="sgd"))  # ~8 GiB fits in 10
    assert calls == [ESExtension.es_setup]


def test_the_replica_host_plans_a_lowrank_replica_as_the_replica_states_it(tmp_path):
    """es.perturbation=lowrank: the replica holds the linear-layer weights alone and its slots' factors, so the check
    plans that (``replica_lines``), not every trainable tensor: free memory between the two passes lowrank only."""
    from es_ray.core.config import ConfigError
    from es_ray.engines.vllm import VLLMReplicaHost
    from es_ray.engines.vllm_extension import ESExtension
    from es_ray.lowrank import LowRankSlots

    engine, _ = fake_engine(tmp_path, share=0.5, max_model_len=2048)
    engine.lowrank = LowRankSlots(members=16, rank=8)
    m, s = preset("qwen2.5-1.5b"), Settings(optimizer="adam", noise="auto")
    full = plan_es(m, s)
    lowrank = plan_es(m, replace(s, perturbation="lowrank", rank=8, members=16))
    assert lowrank.item_bytes("es", "low-rank factors") > 0 and lowrank.part("es") < full.part("es") - GiB
    free = (lowrank.part("es") + full.part("es")) // 2
    calls = []
    engine._rpc = lambda method, *args: (
        [(free, 40 * GiB)] if method is ESExtension.es_device_memory else calls.append(method)
    )
    host = VLLMReplicaHost(engine)
    with pytest.raises(ConfigError):
        host.setup(replica_spec())
    host.setup(replica_spec(perturbation="lowrank"))
    assert calls == [ESExtension.es_setup]


def test_the_engine_share_comes_from_the_plan(tmp_path):
    engine, cls = fake_engine(tmp_path, share=None, max_model_len=2048)
    share = cls._planned_share(engine, 80 * GiB)
    shape, settings = engine._plan_settings(**vllm_batch_defaults(80 * GiB))
    assert settings.tokens_per_sequence == 2048 and settings.engine_dtype_bytes == 2
    assert share == auto_gpu_memory_utilization(shape, 80 * GiB, settings) != 0.5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    assert cls._planned_share(engine, 80 * GiB) == 0.5  # a model the plan cannot count: the old fixed share


# -- the command line and the README ---------------------------------------------------------------------------


def run_cli(*args: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "es_ray.memory_plan", *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_cli_prints_the_table_for_presets_and_a_config_file(tmp_path):
    out = run_cli()
    assert "| model | params | setup | 24 GB | 40 GB | 80 GB |" in out
    for name in PRESETS:
        assert f"| {name} | " in out
    assert "| qwen2.5-7b | 7.62B | ES, adam | " in out and "no (no TP fits)" in out
    (tmp_path / "config.json").write_text(json.dumps(SMALL["qwen2"]))
    out = run_cli("--config", str(tmp_path / "config.json"), "--cards", "1", "--detail")
    assert "| ES, sgd | " in out and "| es | fp32 master |" in out and "qwen2.5" not in out


def test_cli_names_a_config_it_cannot_read_in_one_line(tmp_path, capsys):
    from es_ray.memory_plan.table import main

    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2"}))
    for path, why in (
        (tmp_path / "missing.json", "No such file"),
        (tmp_path / "bad.json", "Expecting"),
        (tmp_path / "gpt2.json", "not Llama- or Qwen2-shaped"),
        (tmp_path, "No such file"),
    ):
        with pytest.raises(SystemExit) as exit:
            main(["--config", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit.value.code == 2 and f"--config {path}: " in err[-1] and why in err[-1], err


def test_docs_table_is_the_cli_output():
    section = (REPO / "docs" / "memory-plan.md").read_text()
    table = run_cli().split("\n\n")[0].strip()
    assert table in section, "docs/memory-plan.md's table is stale: paste `python -m es_ray.memory_plan`"
    assert "(docs/memory-plan.md)" in (REPO / "README.md").read_text()  # the README's index reaches it


# -- the start-up check (every trainer and es-compare stage, before any model loads) --------------------------------


def compose_compare(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from es_ray.launch.compare.run import register_configs, to_compare_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return to_compare_config(compose(config_name="es_compare", overrides=overrides))


STAGE_KINDS = {"train_es": "es", "train_grpo": "grpo", "eval": "eval"}


@pytest.mark.parametrize("experiment", ["paper_easy", "paper_hard"])
@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "llama3.2-3b", "qwen2.5-7b", "r1-distill-qwen-1.5b"])
def test_paper_presets_fit_8_x_80gb_at_every_stage(experiment, model):
    """Arithmetic only: every es-compare stage's plan (ES with its optimizer; GRPO sharded, as the presets set it)
    fits an 80 GB card as it reports itself, and GRPO's learner ranks and rollouts fit the 8 GPUs of cluster=gpu8."""
    from es_ray.memory_plan import card_bytes, plan_for, usable_bytes
    from es_ray.launch.compare.run import stage_plan

    cfg = compose_compare([f"experiment={experiment}", f"model={model}", "cluster=gpu8"])
    shape, card = preset(model), card_bytes(80)
    kinds = set()
    for method in cfg.methods:
        for spec in stage_plan(cfg, method, Path("/tmp/plan"), pool=7473):
            kind = STAGE_KINDS.get(spec.kind)
            if kind is None:
                continue  # es-drift reads two checkpoints on the host
            stage = spec.config()
            plan = plan_for(kind, stage, shape, card)
            assert plan.refusal(usable_bytes(card)) is None, (spec.name, plan.markdown())
            kinds.add(kind)
            if kind == "grpo":
                g = stage.grpo
                assert g.gradient_checkpointing and g.dtype == "bf16_mixed"
                ranks = (
                    max(g.fsdp_size, stage.cluster.num_actors) if g.colocate else g.fsdp_size + stage.cluster.num_actors
                )
                assert ranks * stage.cluster.gpus_per_actor <= 8, spec.name
                assert (
                    not plan_grpo(shape, replace(plan.settings, fsdp_size=1, gradient_checkpointing=False)).fits(
                        usable_bytes(card)
                    )
                    or model != "qwen2.5-7b"
                )  # what the presets' sharding is for
    assert kinds == {"es", "grpo", "eval"}


def qwen7b_dir(tmp_path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in PRESETS["qwen2.5-7b"].items() if k != "hub"}))
    return tmp_path


def grpo_cfg(model_dir, **grpo):
    from es_ray.grpo.config import to_grpo_config

    return to_grpo_config(
        {"model": {"path": str(model_dir)}, "grpo": grpo, "cluster": {"gpus_per_actor": 1, "num_actors": 1}}
    )


def test_startup_check_refuses_the_unsharded_7b_learner_and_names_the_keys(tmp_path):
    from es_ray.core.config import ConfigError
    from es_ray.memory_plan import card_bytes, startup_check

    model = qwen7b_dir(tmp_path)
    cfg = grpo_cfg(model, gradient_checkpointing=False, prompts_per_step=4, group_size=8)
    with pytest.raises(ConfigError) as err:
        startup_check("grpo", cfg, reported=card_bytes(80))
    msg = str(err.value)
    assert (
        "grpo.fsdp_size>=" in msg
        and "grpo.gradient_checkpointing=true" in msg
        and "79.6 GiB the GPU reports" in msg
        and "AdamW moments" in msg
    )
    ok = grpo_cfg(model, gradient_checkpointing=True, dtype="bf16_mixed", fsdp_size=4)
    assert startup_check("grpo", ok, reported=card_bytes(80)).gpus["learner"] < 60 * GiB
    assert startup_check("grpo", ok, reported=card_bytes(141)) is not None
    # 2 ranks on 40 GB cards
    with pytest.raises(ConfigError, match=r"set grpo.fsdp_size>=4 or grpo.offload=optimizer;"):
        startup_check(
            "grpo",
            grpo_cfg(model, gradient_checkpointing=True, dtype="bf16_mixed", fsdp_size=2),
            reported=card_bytes(40),
        )


def test_startup_check_on_cpu_counts_every_process_against_host_ram(tmp_path):
    from es_ray.core.config import ConfigError
    from es_ray.memory_plan import startup_check
    from es_ray.grpo.config import to_grpo_config

    cfg = to_grpo_config({"model": {"path": str(qwen7b_dir(tmp_path))}, "cluster": {"num_actors": 1}})
    with pytest.raises(ConfigError, match="host memory .* grpo.fsdp_size"):
        startup_check("grpo", cfg, host=64 * GiB)
    assert startup_check("grpo", cfg, host=1024 * GiB) is not None


def test_grpo_train_refuses_before_any_model_loads(tmp_path, monkeypatch):
    """A directory with only a 7B config.json: the plan refuses; no weights are looked for and Ray never starts."""
    from es_ray.core.config import ConfigError
    from es_ray.grpo import driver

    monkeypatch.setattr("es_ray.memory_plan.startup.host_bytes", lambda: 24 * GiB)
    cfg = replace(grpo_cfg(qwen7b_dir(tmp_path)), cluster=replace(grpo_cfg(tmp_path).cluster, gpus_per_actor=0))
    monkeypatch.setattr("es_ray.runtime.cluster.connect", lambda *a: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match="host memory"):
        driver.run(cfg)
    assert not (tmp_path / "runs").exists()


def test_offload_names_agree_and_bad_fsdp_settings_are_refused(tmp_path):
    from es_ray.core.config import ConfigError
    from es_ray.memory_plan import OFFLOADS
    from es_ray.grpo.config import OFFLOADS as GRPO_OFFLOADS, to_grpo_config

    assert OFFLOADS is GRPO_OFFLOADS  # one registry: the learner's memory statement's, which the config checks
    for grpo, key in (
        ({"fsdp_size": 0}, "grpo.fsdp_size=0"),
        ({"fsdp_size": 3}, "does not divide"),
        ({"offload": "gpu"}, "grpo.offload"),
    ):
        with pytest.raises(ConfigError, match=key):
            to_grpo_config({"grpo": grpo})


def test_fsdp_offload_and_colocation_arithmetic():
    m = preset("qwen2.5-7b")
    one, four = plan_grpo(m, Settings(learner="bf16_mixed")), plan_grpo(m, Settings(learner="bf16_mixed", fsdp_size=4))
    state = ("weights", "gradients", "AdamW moments")
    assert sum(four.item_bytes("learner", k) for k in state) == pytest.approx(
        sum(one.item_bytes("learner", k) for k in state) / 4, abs=8
    )
    assert four.item_bytes("learner", "activations") == one.item_bytes("learner", "activations") // 4
    opt = plan_grpo(m, Settings(learner="bf16_mixed", fsdp_size=4, offload="optimizer"))
    assert opt.item_bytes("host", "AdamW") == four.item_bytes("learner", "AdamW") and opt.part("learner") == four.part(
        "learner"
    ) - four.item_bytes("learner", "AdamW")
    colo = plan_grpo(m, Settings(learner="bf16_mixed", fsdp_size=8, colocate=True))
    assert set(colo.gpus) == {"colocated"} and colo.total >= colo.part("vllm") + colo.item_bytes("learner", "AdamW")
    floor = plan_es(m, Settings(sequences=1, tokens_per_sequence=1024, kv_floor_tokens=32768))
    assert floor.item_bytes("vllm", "KV cache") == 32768 * m.kv_bytes_per_token(2)
    low = plan_es(m, Settings(perturbation="lowrank", rank=4, members=8))
    assert low.item_bytes("es", "low-rank") == 2 * low.item_bytes("vllm", "LoRA slots") > 0


def test_es_compare_refuses_a_stage_that_cannot_fit_before_any_work(tmp_path, monkeypatch):
    """es-compare checks every stage's plan when it starts, before its run dir, the model or Ray; composing the
    same preset (config conversion, --help) does not depend on this machine's memory."""
    from es_ray.core.config import ConfigError
    from es_ray.launch.compare import run as compare

    monkeypatch.setattr("es_ray.memory_plan.startup.host_bytes", lambda: 24 * GiB)
    monkeypatch.setattr("es_ray.runtime.cluster.connect", lambda *a: pytest.fail("Ray started"))
    (tmp_path / "model").mkdir()
    model = qwen7b_dir(tmp_path / "model")
    run_dir = tmp_path / "cmp"
    cfg = compose_compare([f"model.path={model}", f"run.dir={run_dir}", "methods=[base,grpo]"])
    with pytest.raises(ConfigError, match="host memory"):
        compare.run(cfg)
    assert not run_dir.exists()
    remote = replace(cfg, cluster=replace(cfg.cluster, address="ray://head:10001"))
    compare.check_stage_memory(remote)  # a cluster's nodes size their own actors: nothing to refuse on this host


def test_es_train_refuses_before_any_model_loads(tmp_path, monkeypatch):
    """es-train's plan against this host: 7B with Adam on two local CPU actors is refused before Ray starts."""
    from es_ray.es import driver
    from es_ray.es.config import to_train_config
    from es_ray.core.config import ConfigError

    monkeypatch.setattr("es_ray.memory_plan.startup.host_bytes", lambda: 24 * GiB)
    monkeypatch.setattr("es_ray.runtime.cluster.connect", lambda *a: pytest.fail("Ray started"))
    cfg = to_train_config(
        {
            "model": {"path": str(qwen7b_dir(tmp_path))},
            "es": {"optimizer": "adam"},
            "cluster": {"num_actors": 2},
            "run": {"dir": str(tmp_path / "run")},
        }
    )
    with pytest.raises(ConfigError, match="host memory .* cluster.num_actors"):
        driver.run(cfg)
    assert not (tmp_path / "run").exists()
