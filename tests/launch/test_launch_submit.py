"""es-submit: sweep expansion and run directories (pure), bad input refused before anything is sent, and real
Ray Jobs on a Ray head started here with its dashboard (`ray start --head`, own ports and temp dir): a tiny
es-train ends SUCCEEDED with its outputs in the absolute run directory; a failing job makes `--wait` exit 1."""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from es_ray.launch.submit import SubmitError, expand_sweep, parse_args, plan, split_values
from paths import REPO


def test_values_split_on_top_level_commas_only():
    assert split_values("1e-3,2e-3") == ["1e-3", "2e-3"]
    assert split_values("[1,16],[1,32],'a,b'") == ["[1,16]", "[1,32]", "'a,b'"]


def test_sweep_is_the_cartesian_product():
    assert expand_sweep(["a=1,2", "b=x,y,z"]) == [[f"a={a}", f"b={b}"] for a in "12" for b in "xyz"]
    assert expand_sweep([]) == [[]]
    for bad in (["a"], ["a="], ["a=1,"], ["a=1", "a=2"]):
        with pytest.raises(SubmitError):
            expand_sweep(bad)


def test_sweep_jobs_get_distinct_absolute_run_dirs(tmp_path):
    subs = plan(["es-train", "model=qwen2.5-1.5b"], ["es.sigma=1e-3,2e-3", "es.lr=5e-7,1e-6"], str(tmp_path))
    assert len(subs) == 4 and len({s.run_dir for s in subs}) == 4 and len({s.submission_id for s in subs}) == 4
    for s in subs:
        assert Path(s.run_dir).is_absolute() and Path(s.run_dir).parent.parent == tmp_path
        assert s.command[:2] == ["es-train", "model=qwen2.5-1.5b"]  # the user's overrides, unchanged and first
        assert s.command[-1] == f"run.dir={s.run_dir}"
    assert subs[0].command[2:4] == ["es.sigma=1e-3", "es.lr=5e-7"]
    assert "es.sigma_1e-3-es.lr_5e-7" in subs[0].run_dir


def test_run_dir_rules(tmp_path):
    one = plan(["es-eval", "eval.n=4"], [], str(tmp_path))[0]
    assert one.run_dir == str(tmp_path / one.submission_id) and one.submission_id.startswith("es-eval-")
    given = plan(["es-train", f"run.dir={tmp_path}/mine"], [], "")[0]
    assert given.run_dir == f"{tmp_path}/mine" and given.command == ["es-train", f"run.dir={tmp_path}/mine"]
    from_override = plan(["es-train", f"run.root={tmp_path}"], [], "")[0]
    assert Path(from_override.run_dir).parent == tmp_path
    spaced = plan(["es-train"], [], str(tmp_path / "a b"))[0]
    assert spaced.command[-1] == f"run.dir='{spaced.run_dir}'"  # quoted for Hydra's grammar
    other = plan(["python", "-c", "print(1)"], [], "")[0]  # not a project entry point: untouched, no run dir
    assert other.command == ["python", "-c", "print(1)"] and other.run_dir == ""


@pytest.mark.parametrize(
    "command, sweep, root, message",
    [
        (["es-train"], [], "", "no run root"),
        (["es-train"], [], "relative/runs", "must be an absolute path"),
        (["es-train", "run.dir=rel"], [], "/abs", "must be absolute"),
        (["es-train", "run.dir=/abs/x"], ["es.sigma=1,2"], "/abs", "same directory"),
        (["es-train", "es.sigma=1"], ["es.sigma=1,2"], "/abs", "both after `--` and in --sweep"),
        (["es-train", "-m", "es.sigma=1,2"], [], "/abs", "use es-submit --sweep"),
        ([], [], "/abs", "no command"),
    ],
)
def test_bad_plans_are_refused_with_what_to_change(command, sweep, root, message):
    with pytest.raises(SubmitError, match=message):
        plan(command, sweep, root)


def test_everything_after_the_separator_is_the_command():
    args, command = parse_args(
        ["--address", "http://h:8265", "--sweep", "a=1,2", "b=3", "--", "es-train", "--cfg", "job", "x=1"]
    )
    assert args.address == "http://h:8265" and args.sweep == ["a=1,2", "b=3"]
    assert command == ["es-train", "--cfg", "job", "x=1"]


def es_submit(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["es-submit", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def test_dry_run_composes_each_job_and_refuses_a_bad_override(tmp_path):
    res = es_submit(
        "--dry-run",
        "--run-root",
        str(tmp_path),
        "--sweep",
        "es.sigma=1e-3,2e-3",
        "--",
        "es-train",
        "model=qwen2.5-1.5b",
        "cluster=gpu8",
    )
    assert res.returncode == 0, res.stderr
    rows = [line.split("\t") for line in res.stdout.splitlines()]
    assert len(rows) == 2 and all(r[1].startswith(str(tmp_path)) for r in rows)
    assert all(r[2].startswith("es-train model=qwen2.5-1.5b cluster=gpu8 es.sigma=") for r in rows)
    typo = es_submit("--dry-run", "--run-root", str(tmp_path), "--", "es-train", "es.populaton=4")
    assert typo.returncode == 2 and "es.populaton" in typo.stderr
    assert "did you mean es.population?" in typo.stderr and typo.stderr.strip().count("\n") == 0, typo.stderr
    invalid = es_submit("--dry-run", "--run-root", str(tmp_path), "--", "es-train", "es.population=1")
    assert invalid.returncode == 2 and "es.population" in invalid.stderr


# -- a real Ray head with its dashboard and job server -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_processes_of(temp_dir: str) -> None:
    """Stop only this head: every process whose command line names its temp dir, with their children."""
    import psutil

    roots = [p for p in psutil.process_iter(["cmdline"]) if any(temp_dir in a for a in (p.info["cmdline"] or []))]
    procs = {}
    for root in roots:
        try:
            procs.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="esray", dir="/tmp")  # short: Ray's socket paths must stay < 108 bytes
    dash = _free_port()
    ports = {
        "--port": _free_port(),
        "--dashboard-port": dash,
        "--ray-client-server-port": _free_port(),
        "--node-manager-port": _free_port(),
        "--object-manager-port": _free_port(),
        "--dashboard-agent-listen-port": _free_port(),
        "--dashboard-agent-grpc-port": _free_port(),
        "--runtime-env-agent-port": _free_port(),
        "--metrics-export-port": _free_port(),
    }
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [
        "ray",
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--num-cpus=2",
        "--min-worker-port=0",
        "--max-worker-port=0",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
        *[f"{k}={v}" for k, v in ports.items()],
    ]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        yield f"http://127.0.0.1:{dash}", env
    finally:
        _kill_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.ray
def test_es_train_job_succeeds_with_outputs_in_the_absolute_run_dir(ray_head, tiny_model_dir, tmp_path):
    address, env = ray_head
    res = es_submit(
        "--address",
        address,
        "--run-root",
        str(tmp_path / "runs"),
        "--wait",
        "--",
        "es-train",
        f"model.path={tiny_model_dir}",
        "task.name=arithmetic",
        "es.population=2",
        "es.iterations=1",
        "es.prompts_per_iteration=2",
        "sampling.max_new_tokens=4",
        "cluster.num_actors=1",
        "eval.every=0",
        "run.progress=false",
        "run.trackers=[]",
        timeout=400,
        env=env,
    )
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    job_id = next(line.split()[1] for line in out.splitlines() if line.startswith("submitted "))
    assert f"{job_id}: SUCCEEDED" in out and f"es-submit stop --address {address} {job_id}" in out
    run_dir = tmp_path / "runs" / job_id
    assert f"run dir {run_dir}" in out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0]
    assert (run_dir / "checkpoints" / "final" / "model.safetensors").is_file()
    assert json.loads((run_dir / "config.json").read_text())["run"]["dir"] == str(run_dir)


@pytest.mark.ray
def test_failing_job_exits_1_and_ships_the_tree_without_git_or_outputs(ray_head):
    address, env = ray_head
    probe = "import os, sys; print('LISTING', sorted(os.listdir('.'))); sys.exit(3)"
    res = es_submit("--address", address, "--wait", "--", "python", "-c", probe, timeout=300, env=env)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert ": FAILED" in res.stdout
    listing = next(line for line in res.stdout.splitlines() if line.startswith("LISTING"))
    shipped = ast.literal_eval(listing.removeprefix("LISTING "))
    assert {"es_ray", "launch", "conf", "pyproject.toml"} <= set(shipped)
    assert not {".git", ".venv", "runs"} & set(shipped), shipped


# -- what is uploaded ------------------------------------------------------------------------------------------

SECRETS = [
    ".env",
    ".env.local",
    ".netrc",
    ".git-credentials",
    ".aws/credentials",
    ".ssh/id_rsa",
    "id_ed25519",
    "deploy/server.pem",
    "wandb/run-1/files/config.yaml",
    "mlruns/0/meta.yaml",
    "runs/r1/model.safetensors",
    "checkpoints/step_10/state.pt",
    "sub/.env",
    "sub/runs/x.json",
]
CODE = ["main.py", "pkg/__init__.py", "pkg/envelope.py", "conf/a.yaml", "README.md"]


def _tree(root: Path) -> None:
    for rel in SECRETS + CODE:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x" * 100)


def test_secrets_and_run_outputs_are_never_uploaded_whatever_the_runtime_env(tmp_path, capsys):
    from es_ray.launch.submit import SECRET_EXCLUDES, print_upload, runtime_env, upload_listing

    work = tmp_path / "work"
    _tree(work)
    bare = tmp_path / "bare.yaml"
    bare.write_text("env_vars: {A: '1'}\n")  # a user's runtime_env without a single exclude
    for path in (None, bare):
        env = runtime_env(work, path) if path else runtime_env(work)
        assert set(SECRET_EXCLUDES) <= set(env["excludes"])
        rows, total = upload_listing(work, env["excludes"])
        assert {r[0] for r in rows} == {"main.py", "pkg/", "conf/", "README.md"}
        assert total == 100 * len(CODE)
    # Ray's own matcher (the gitwildmatch it applies to runtime_env excludes) leaves out the same files
    from ray._private.thirdparty.pathspec import PathSpec

    spec = PathSpec.from_lines("gitwildmatch", env["excludes"])
    assert sorted(r for r in SECRETS + CODE if not spec.match_file(r)) == sorted(CODE)
    print_upload(env)
    err = capsys.readouterr().err
    assert "uploading" in err and "500 B in 5 files" in err and ".env" not in err.replace("SECRET_EXCLUDES", "")


# -- the local check finds its command -------------------------------------------------------------------------


def test_the_local_check_finds_the_entry_point_beside_es_submit_without_path(tmp_path):
    """A venv that is not activated: es-submit run by its path finds es-train in its own bin dir."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [str(bindir / "es-submit"), "--dry-run", "--run-root", str(tmp_path), "--", "es-train", "es.population=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    assert res.returncode == 2 and "es.population" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


def test_a_command_found_nowhere_is_one_line_naming_it(monkeypatch, tmp_path):
    from es_ray.launch import submit

    monkeypatch.setattr(submit.shutil, "which", lambda name: None)
    monkeypatch.setattr(submit.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(SubmitError, match=r"es-eval: command not found on PATH nor in .*activate"):
        submit.check_overrides(["es-eval", "eval.n=4"])


# -- a job server's refusals, each one line with the fix (a canned HTTP server on loopback) -----------------------


class _Canned:
    """A tiny HTTP server on 127.0.0.1 answering /api/version like Ray's job server and every other request with
    ``status``/``body``; ``token`` set: requests without `Authorization: Bearer <token>` get 401."""

    def __init__(self, status: int = 200, body: str = "{}", version_status: int = 200, token: str = ""):
        import http.server
        import threading

        canned = self
        self.status, self.body, self.version_status, self.token, self.seen = status, body, version_status, token, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                canned.seen.append((self.command, self.path, self.headers.get("Authorization")))
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                if canned.token and self.headers.get("Authorization") != f"Bearer {canned.token}":
                    code, body = 401, "Unauthorized: missing or invalid token"
                elif self.path.startswith("/api/version"):
                    code = canned.version_status
                    body = json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"})
                else:
                    code, body = canned.status, canned.body
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def canned():
    servers = []

    def start(**kw) -> _Canned:
        servers.append(_Canned(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _submit_to(address: str, tmp_path: Path, monkeypatch, capsys, *extra: str) -> tuple[int, str]:
    from es_ray.launch.submit import main

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "main.py").write_text("print(1)\n")
    with pytest.raises(SystemExit) as exit_info:
        main([*extra, "--address", address, "--working-dir", str(work), "--no-check", "--", "python", "main.py"])
    err = capsys.readouterr().err
    return exit_info.value.code, "\n".join(
        ln for ln in err.splitlines() if ln.startswith("es-submit: ") and "uploading" not in ln
    )


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"status": 500, "body": "No available agent to submit job"}, "dashboard agent is not"),
        (
            {"status": 401, "body": "Unauthorized"},
            "uses token authentication and no token was sent: set RAY_AUTH_TOKEN",
        ),
        ({"status": 403, "body": "Forbidden"}, "refused the auth token"),
        ({"version_status": 404}, "is not a Ray job server"),
    ],
)
def test_job_server_refusals_are_one_line_with_the_fix(canned, kw, expected, tmp_path, monkeypatch, capsys):
    server = canned(**kw)
    code, line = _submit_to(server.address, tmp_path, monkeypatch, capsys)
    assert code == 2 and expected in line and line.count("\n") == 0, line
    if kw.get("status") == 500:
        assert "port" in line and "ray stop" in line


def test_wrong_address_is_one_line(tmp_path, monkeypatch, capsys):
    code, line = _submit_to("http://127.0.0.1:9", tmp_path, monkeypatch, capsys)
    assert code == 2 and "unreachable" in line and line.count("\n") == 0, line


@pytest.mark.parametrize(
    "argv", [["--address", "http://127.0.0.1:9", "status", "job-1"], ["--address=http://127.0.0.1:9", "logs", "job-1"]]
)
def test_address_before_a_job_command_is_taken_as_after_it(argv, capsys):
    """`es-submit --address URL status JOB`, as a submission puts --address first: the job command runs against
    that address (here: nothing answers there), not an argparse refusal of `status JOB`."""
    from es_ray.launch.submit import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "127.0.0.1:9" in err and "unreachable" in err, err


def test_job_commands_carry_the_token(canned, tmp_path):
    """`es-submit status|logs|stop JOB` send the token es-submit finds (RAY_AUTH_TOKEN), as a submission does;
    without one the refusal is one line naming the fix. Subprocesses: Ray reads its auth mode once per process."""
    from es_ray.launch.submit import follow_hint

    info = {
        "type": "SUBMISSION",
        "job_id": None,
        "submission_id": "job-1",
        "status": "FAILED",
        "entrypoint": "python main.py",
        "message": "Job entrypoint command failed with exit code 3",
    }
    server = canned(body=json.dumps(info), token="s3cret")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token
    no_token = es_submit("status", "--address", server.address, "job-1", timeout=120, env=env)
    assert no_token.returncode == 2 and "no token was sent: set RAY_AUTH_TOKEN" in no_token.stderr, no_token.stderr
    assert no_token.stderr.strip().count("\n") == 0, no_token.stderr
    status = es_submit(
        "status", "--address", server.address, "job-1", timeout=120, env={**env, "RAY_AUTH_TOKEN": "s3cret"}
    )
    assert status.returncode == 1 and status.stdout.startswith("job-1: FAILED"), status.stdout + status.stderr
    assert "exit code 3" in status.stdout
    assert server.seen[-1][:2] == ("GET", "/api/jobs/job-1") and server.seen[-1][2] == "Bearer s3cret"
    hint = follow_hint(server.address, "job-1")
    assert {line.split(":", 1)[1].split()[1] for line in hint.splitlines()} == {"logs", "status", "stop"}
    assert all(line.split(":", 1)[1].strip().startswith("es-submit ") for line in hint.splitlines())


@pytest.mark.ray
def test_sweep_wait_prints_every_jobs_end_state_and_job_commands_work(ray_head):
    address, env = ray_head
    res = es_submit(
        "--address",
        address,
        "--wait",
        "--sweep",
        "code=0,3",
        "--",
        "python",
        "-c",
        "import sys; print('CODE', sys.argv[-1]); sys.exit(int(sys.argv[-1].split('=')[1]))",
        timeout=300,
        env=env,
    )
    ids = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("submitted ")]
    assert res.returncode == 1 and len(ids) == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{ids[0]}: SUCCEEDED" in res.stdout and f"{ids[1]}: FAILED" in res.stdout
    assert "1 of 2 jobs SUCCEEDED" in res.stdout
    assert f"es-submit status --address {address} {ids[0]}" in res.stdout
    status = subprocess.run(
        ["es-submit", "status", "--address", address, ids[0]], capture_output=True, text=True, timeout=120, env=env
    )
    assert status.returncode == 0 and status.stdout.startswith(f"{ids[0]}: SUCCEEDED"), status.stderr[-2000:]
    logs = subprocess.run(
        ["es-submit", "logs", "--address", address, ids[1]], capture_output=True, text=True, timeout=120, env=env
    )
    assert logs.returncode == 0 and "CODE code=3" in logs.stdout, logs.stdout[-2000:] + logs.stderr[-2000:]
