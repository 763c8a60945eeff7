"""`es-submit`: run any entry point as a Ray Job, Hydra overrides passed through unchanged.

    es-submit --address http://HEAD:8265 --run-root /mnt/shared/runs -- es-train model=qwen2.5-1.5b cluster=gpu8
    es-submit --address http://HEAD:8265 --run-root /mnt/shared/runs --sweep es.sigma=1e-3,2e-3 es.lr=1e-6,5e-7 \
        -- es-train experiment=es_reference_gsm8k
    es-submit --wait -- es-eval model.path=/mnt/shared/runs/<id>/checkpoints/final

The working directory is shipped with launch/runtime_env.yaml, never with credentials or run outputs (SECRET_EXCLUDES:
.env*, .netrc, .aws/, .ssh/, id_*, *.pem, wandb/, mlruns/, runs/, checkpoints/, ...); what goes is listed with its size
before anything is sent. A cluster with Ray's token authentication gets its token from RAY_AUTH_TOKEN,
RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (docs/security.md). A Ray Job's driver runs in a temporary copy of the
working directory, so for the project's entry points es-submit sets `run.dir=<run root>/<job id>` (or keeps
an absolute `run.dir=` given), on storage every node sees. `--sweep` submits one job per combination of values,
each with its own run directory (Hydra's Ray launcher plugin is not used). `--wait` streams a single job's logs (a
sweep: waits for every job), prints each job's end state and exits 0 when every job SUCCEEDED, 1 otherwise.

    es-submit status|stop --address http://HEAD:8265 JOB
    es-submit logs [--follow] --address http://HEAD:8265 JOB

Ray's job commands with the same address and token as the submission (the hints printed after submitting);
``--address`` may also come before the command word, as it does in a submission. A job
server's refusal is one line with the likely cause and the fix (``job_server_error``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import itertools
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import distribution
from pathlib import Path

import yaml

from es_ray.core.config import ConfigError
from es_ray.runtime.cluster import check_address

# Ray's job client, requests and the methods' configs (numpy) are imported where a job is checked or sent: es-submit
# --help and a bad flag need none of them.

LAUNCH_DIR = Path(__file__).resolve().parent
REPO_DIR = LAUNCH_DIR.parent
RUNTIME_ENV = LAUNCH_DIR / "runtime_env.yaml"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(ValueError):
    """Bad es-submit input; the message says what to change."""


@dataclass
class Submission:
    submission_id: str
    command: list[str]
    run_dir: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def entrypoint(self) -> str:
        return shlex.join(self.command)


def project_scripts() -> dict[str, str]:
    """The project's console scripts, name -> target, from pyproject.toml beside launch/ (else the installed
    metadata): these are the Hydra entry points that get a run directory."""
    pyproject = REPO_DIR / "pyproject.toml"
    if pyproject.is_file():
        return dict(tomllib.loads(pyproject.read_text())["project"].get("scripts", {}))
    return {ep.name: ep.value for ep in distribution("es-ray").entry_points if ep.group == "console_scripts"}


def hydra_entry_points() -> set[str]:
    return {name for name in project_scripts() if name != "es-submit"}


def split_values(text: str) -> list[str]:
    """'a,b,[1,2]' -> ['a', 'b', '[1,2]']: commas inside brackets or quotes do not split."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    out.append(cur)
    return out


def expand_sweep(specs: list[str]) -> list[list[str]]:
    """['a=1,2', 'b=x,y'] -> [['a=1', 'b=x'], ['a=1', 'b=y'], ['a=2', 'b=x'], ['a=2', 'b=y']]."""
    axes = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise SubmitError(f"--sweep {spec!r} is not key=v1,v2,...; e.g. --sweep es.sigma=1e-3,2e-3")
        vals = split_values(values)
        if any(v == "" for v in vals):
            raise SubmitError(f"--sweep {spec!r} has an empty value; list values as key=v1,v2")
        axes.append([f"{key}={v}" for v in vals])
    if len({a[0].partition("=")[0] for a in axes}) != len(axes):
        raise SubmitError(f"--sweep names a key twice: {specs}; give each key once with all its values")
    return [list(combo) for combo in itertools.product(*axes)] if axes else [[]]


def _override(overrides: list[str], key: str) -> str | None:
    for o in overrides:
        k, sep, v = o.lstrip("+").partition("=")
        if sep and k == key:
            return v
    return None


def _slug(overrides: list[str]) -> str:
    """A directory name for a sweep combination: es.sigma=1e-3 es.lr=5e-7 -> es.sigma_1e-3-es.lr_5e-7."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", "-".join(overrides))[:120]


def _hydra_value(text: str) -> str:
    """Quote a value for Hydra's override grammar unless it is a plain path."""
    return text if re.fullmatch(r"[A-Za-z0-9._/:~+-]+", text) else "'" + text.replace("'", "\\'") + "'"


def plan(command: list[str], sweep: list[str], run_root: str, name: str = "") -> list[Submission]:
    """One Submission per sweep combination: ids, entrypoints and absolute run directories."""
    if not command:
        raise SubmitError(
            "no command after `--`; e.g. es-submit --address http://HEAD:8265 -- es-train es.iterations=5"
        )
    program, overrides = command[0], command[1:]
    if any(a in ("-m", "--multirun") for a in overrides):
        raise SubmitError("Hydra multirun (-m) is not used on a cluster; use es-submit --sweep key=a,b (one job each)")
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    base_id = f"{name or Path(program).name}-{stamp}"
    combos = expand_sweep(sweep)
    is_hydra = program in hydra_entry_points()
    if not is_hydra:
        return [
            Submission(
                base_id if len(combos) == 1 else f"{base_id}-{i:02d}",
                [program, *overrides, *combo],
                metadata={"sweep": " ".join(combo)} if combo else {},
            )
            for i, combo in enumerate(combos)
        ]
    swept = {c.partition("=")[0] for c in combos[0]}
    clash = swept & {o.lstrip("+").partition("=")[0] for o in overrides}
    if clash:
        raise SubmitError(f"{sorted(clash)} given both after `--` and in --sweep; give each once")
    fixed_dir = _override(overrides, "run.dir")
    if fixed_dir:
        if not os.path.isabs(fixed_dir):
            raise SubmitError(f"run.dir={fixed_dir!r} must be absolute: a Ray Job runs in a temporary directory")
        if len(combos) > 1:
            raise SubmitError("run.dir= with --sweep would give every job the same directory; use --run-root instead")
        return [Submission(base_id, command, fixed_dir, {"run_dir": fixed_dir})]
    root = _override(overrides, "run.root") or run_root
    if not root:
        raise SubmitError(
            "no run root: pass --run-root /shared/runs (or set ES_RUN_ROOT, or run.root=/abs after "
            "`--`), a directory every node of the cluster sees; a Ray Job's own directory is temporary"
        )
    if not os.path.isabs(root):
        raise SubmitError(f"run root {root!r} must be an absolute path on storage every node sees")
    subs = []
    for i, combo in enumerate(combos):
        sid = base_id if len(combos) == 1 else f"{base_id}-{i:02d}"
        run_dir = str(Path(root) / sid) if len(combos) == 1 else str(Path(root) / base_id / f"{i:02d}-{_slug(combo)}")
        meta = {"run_dir": run_dir, **({"sweep": " ".join(combo)} if combo else {})}
        subs.append(Submission(sid, [program, *overrides, *combo, f"run.dir={_hydra_value(run_dir)}"], run_dir, meta))
    return subs


def _validators() -> dict:
    """Entry points whose composed config es_ray can also validate (value checks beyond the schema's types)."""
    from es_ray.es.config import to_train_config
    from es_ray.evaluation.config import to_drift_config, to_eval_config
    from es_ray.grpo.config import to_grpo_config
    from es_ray.launch.compare.run import to_compare_config

    return {
        "es-train": to_train_config,
        "es-eval": to_eval_config,
        "es-drift": to_drift_config,
        "grpo-train": to_grpo_config,
        "es-compare": to_compare_config,
    }


def check_overrides(command: list[str]) -> dict | None:
    """Compose a project entry point's config locally (`<script> --cfg job`, then es_ray's validation where it
    has one), so that a misspelt key or a bad value fails here, in seconds, not on the cluster. Returns the
    composed config (None for a command that is not a project entry point)."""
    if command[0] not in hydra_entry_points():
        return None
    res = subprocess.run(
        [local_program(command[0]), *command[1:], "--cfg", "job"], capture_output=True, text=True, timeout=300
    )
    if res.returncode != 0:
        # the entry points print a user's mistake as one line (es_ray.runtime.entry); anything else: its last line
        lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
        first = next((ln for ln in lines if ln.startswith(f"{command[0]}: ")), lines[-1] if lines else "")
        raise SubmitError(
            f"the local check refused it: {first.removeprefix(f'{command[0]}: ')} (or --no-check to skip the check)"
        )
    composed = yaml.safe_load(res.stdout) or {}
    check = _validators().get(command[0])
    if check is not None:
        try:
            check(composed)
        except ConfigError as exc:
            raise SubmitError(f"{shlex.join(command)}: {exc}") from None
    return composed


def local_program(name: str) -> str:
    """The project's entry point for the local check: on PATH, else beside this es-submit (its venv's bin dir, for
    a venv that is not activated); a one-line SubmitError naming it when neither has it."""
    found = shutil.which(name)
    beside = Path(sys.executable).parent / name
    if found:
        return found
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise SubmitError(
        f"{name}: command not found on PATH nor in {beside.parent}; activate the environment that "
        "installed es-ray (e.g. . .venv/bin/activate), or pass --no-check to submit unchecked"
    )


# Never shipped, whatever --runtime-env says: credentials and run outputs (gitignore-style, as Ray's excludes).
SECRET_EXCLUDES = (
    ".env*",
    ".netrc",
    ".git-credentials",
    ".aws/",
    ".ssh/",
    ".kube/",
    ".docker/",
    ".gnupg/",
    "id_*",
    "*.pem",
    "*.key",
    "wandb/",
    "mlruns/",
    "runs/",
    "outputs/",
    "checkpoints/",
    "checkpoint-*/",
)


def runtime_env(working_dir: Path, path: Path = RUNTIME_ENV) -> dict:
    env = yaml.safe_load(path.read_text()) or {}
    if not isinstance(env, dict):
        raise SubmitError(f"{path}: a runtime_env must be a mapping")
    env["working_dir"] = str(working_dir)
    env["excludes"] = list(dict.fromkeys([*(env.get("excludes") or []), *SECRET_EXCLUDES]))
    return env


def _excluded(rel: Path, is_dir: bool, patterns: list[str]) -> bool:
    """gitignore-style, for the shapes the excludes use: 'name', 'glob*', 'dir/', '**/dir/' match a path component
    at any depth (a trailing '/' only a directory); a pattern with an inner '/' matches from the root."""
    parts = rel.parts
    for raw in patterns:
        pat = raw.removeprefix("**/")
        dir_only = pat.endswith("/")
        pat = pat.rstrip("/")
        if "/" in pat:
            if fnmatch.fnmatchcase(rel.as_posix(), pat) and (is_dir or not dir_only):
                return True
            continue
        for i, part in enumerate(parts):
            if fnmatch.fnmatchcase(part, pat) and (not dir_only or i < len(parts) - 1 or is_dir):
                return True
    return False


def upload_listing(working_dir: Path, excludes: list[str]) -> tuple[list[tuple[str, int, int]], int]:
    """What Ray would upload from ``working_dir`` under ``excludes`` (and a top-level .gitignore, which Ray also
    applies): (top-level entry, files, bytes) rows and the total bytes."""
    ignore = working_dir / ".gitignore"
    patterns = list(excludes) + (
        [
            ln.strip()
            for ln in ignore.read_text(errors="replace").splitlines()
            if ln.strip() and not ln.startswith(("#", "!"))
        ]
        if ignore.is_file()
        else []
    )
    rows: dict[str, list[int]] = {}
    for root, dirs, files in os.walk(working_dir):
        base = Path(root).relative_to(working_dir)
        dirs[:] = [d for d in dirs if not _excluded(base / d, True, patterns)]
        for name in files:
            rel = base / name
            if _excluded(rel, False, patterns):
                continue
            try:
                size = (Path(root) / name).lstat().st_size
            except OSError:
                continue
            row = rows.setdefault(rel.parts[0] + ("/" if len(rel.parts) > 1 else ""), [0, 0])
            row[0] += 1
            row[1] += size
    out = sorted(((k, n, b) for k, (n, b) in rows.items()), key=lambda r: -r[2])
    return out, sum(b for _, _, b in out)


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def print_upload(env: dict) -> None:
    """The upload, listed on stderr (stdout stays the jobs' lines) before anything is sent."""
    rows, total = upload_listing(Path(env["working_dir"]), env.get("excludes") or [])
    print(
        f"es-submit: uploading {env['working_dir']}: {_size(total)} in {sum(r[1] for r in rows)} files "
        "(credentials and run outputs left out: launch/submit.py SECRET_EXCLUDES)",
        file=sys.stderr,
    )
    for name, files, size in rows:
        print(f"  {_size(size):>9}  {name}" + (f"  ({files} files)" if files > 1 else ""), file=sys.stderr)


def use_auth_token_if_present() -> None:
    """Send the cluster's auth token when one is at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token),
    as `ray.init` does when it joins a cluster: Ray's job client sends it only with RAY_AUTH_MODE=token."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or path.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def follow_hint(address: str, sid: str) -> str:
    """Commands that work when pasted: es-submit's own, which send the same address and token as this one."""
    return (
        f"  follow: es-submit logs --follow --address {address} {sid}\n"
        f"  status: es-submit status --address {address} {sid}\n"
        f"  stop:   es-submit stop --address {address} {sid}"
    )


def job_server_error(exc: BaseException, address: str) -> str:
    """One line for a job server's refusal: the likely cause and the fix (Ray's own message is a traceback around
    an HTTP status)."""
    text = " ".join(str(exc).split())
    token = "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or copy the head's token to ~/.ray/auth_token)"
    if "No available agent" in text:
        return (
            f"the job server at {address} is up but its node's dashboard agent is not (HTTP 500 'No available "
            "agent to submit job'), most often because a port the agent needs is taken by another Ray on that "
            "host: stop it (`ray stop`) or start the head with free --dashboard-agent-listen-port, "
            "--dashboard-agent-grpc-port and --runtime-env-agent-port; its session's logs/dashboard_agent.log "
            "names the port"
        )
    if "Authentication failed" in text or "status code 403" in text:
        return f"the cluster at {address} refused the auth token (wrong or from another cluster): {token} to its token"
    if "Authentication required" in text or "authentication token" in text.lower() or "status code 401" in text:
        return f"the cluster at {address} uses token authentication and no token was sent: {token}"
    if isinstance(exc, ConnectionError) or "Failed to connect" in text:
        return (
            f"nothing answers as a Ray job server at {address} (wrong address, or the head is down): give the "
            "dashboard's address that `ray start --head` prints, e.g. --address http://HEAD:8265"
        )
    if "404" in text:
        return (
            f"{address} answers but is not a Ray job server (HTTP 404; another service on that port?): give the "
            "dashboard's address, e.g. --address http://HEAD:8265"
        )
    return f"the job server at {address} refused the request: {text[:300]}"


@contextlib.contextmanager
def job_server(address: str):
    """A job-server failure inside the block is one line on stderr (job_server_error) and exit code 2."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except (ConnectionError, RuntimeError, ValueError, AuthenticationError, requests.RequestException) as exc:
        print(f"es-submit: {job_server_error(exc, address)}", file=sys.stderr)
        raise SystemExit(2) from None


def wait_all(client, sids: list[str], stream: bool, poll_s: float = 1.0) -> dict[str, str]:
    """Wait for every job (streaming the logs of a single one), printing each one's end state as it ends:
    `<id>: SUCCEEDED`, or FAILED / STOPPED with the job server's message."""
    if stream:

        async def tail() -> None:
            async for lines in client.tail_job_logs(sids[0]):
                print(lines, end="", flush=True)

        asyncio.run(tail())
    done: dict[str, str] = {}
    while len(done) < len(sids):
        for sid in sids:
            if sid in done:
                continue
            info = client.get_job_info(sid)
            status = getattr(info.status, "value", str(info.status))
            if status in TERMINAL:
                done[sid] = status
                why = (
                    f"  ({' '.join(str(info.message).split())[:300]})" if status != "SUCCEEDED" and info.message else ""
                )
                print(f"{sid}: {status}{why}", flush=True)
        if len(done) < len(sids):
            time.sleep(poll_s)
    return {sid: done[sid] for sid in sids}


JOB_COMMANDS = ("status", "logs", "stop")


def job_command(argv: list[str]) -> None:
    """`es-submit status|logs|stop JOB`: Ray's job commands with the same address and token as a submission."""
    p = argparse.ArgumentParser(
        prog=f"es-submit {argv[0]}", description=f"{argv[0]} of a submitted job, with es-submit's address and token"
    )
    p.add_argument("job", help="the submission id es-submit printed")
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
        help="the cluster's dashboard/job server (default: $RAY_ADDRESS or http://127.0.0.1:8265)",
    )
    if argv[0] == "logs":
        p.add_argument("--follow", action="store_true", help="stream the logs until the job ends")
    args = p.parse_args(argv[1:])
    client = connect_jobs(args.address)
    with job_server(args.address):
        if argv[0] == "status":
            info = client.get_job_info(args.job)
            status = getattr(info.status, "value", str(info.status))
            print(f"{args.job}: {status}" + (f"  ({' '.join(str(info.message).split())})" if info.message else ""))
            raise SystemExit(0 if status in ("SUCCEEDED", "RUNNING", "PENDING") else 1)
        if argv[0] == "stop":
            stopped = client.stop_job(args.job)
            print(f"{args.job}: " + ("stop requested" if stopped else "already ended"))
            return
        if args.follow:
            statuses = wait_all(client, [args.job], stream=True)
            raise SystemExit(0 if statuses[args.job] == "SUCCEEDED" else 1)
        print(client.get_job_logs(args.job), end="")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    else:
        command = []
    p = argparse.ArgumentParser(
        prog="es-submit",
        description=__doc__.split("\n\n")[0],
        usage="es-submit [options] -- COMMAND [hydra overrides ...]\n"
        "       es-submit status|logs|stop [--address URL] JOB",
    )
    p.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "http://127.0.0.1:8265"),
        help="the cluster's dashboard/job server (default: $RAY_ADDRESS or http://127.0.0.1:8265)",
    )
    p.add_argument(
        "--run-root",
        default=os.environ.get("ES_RUN_ROOT", ""),
        help="absolute directory on shared storage; each job's run.dir is created under it (default: $ES_RUN_ROOT)",
    )
    p.add_argument(
        "--sweep", nargs="+", default=[], metavar="KEY=V1,V2", help="one job per combination of these values"
    )
    p.add_argument("--working-dir", default=".", help="directory shipped to the cluster (default: the current one)")
    p.add_argument(
        "--runtime-env", default=str(RUNTIME_ENV), help="runtime_env YAML (default: launch/runtime_env.yaml)"
    )
    p.add_argument("--name", default="", help="prefix of the job ids (default: the command's name)")
    p.add_argument("--wait", action="store_true", help="stream the logs and exit with the job's status")
    p.add_argument("--no-check", action="store_true", help="skip composing the overrides locally before submitting")
    p.add_argument("--dry-run", action="store_true", help="print the jobs without submitting them")
    args = p.parse_args(argv)
    if not command:
        p.error("no command: put the entry point and its overrides after `--`, e.g. -- es-train es.iterations=5")
    return args, command


def connect_jobs(address: str):
    """The cluster's job client; an unreachable or malformed --address is one line and exit code 2."""
    try:
        check_address(address, key="--address")
        use_auth_token_if_present()
        from ray.job_submission import JobSubmissionClient

        with job_server(address):
            return JobSubmissionClient(address)
    except ConfigError as exc:
        print(f"es-submit: {exc}", file=sys.stderr)
    raise SystemExit(2)


def job_argv(argv: list[str]) -> list[str] | None:
    """``argv`` as ``status|logs|stop ...`` when it is a job command, also with --address before the command word
    (where a submission puts it); None for a submission."""
    i = 0
    while i < len(argv) and argv[i].startswith("--address"):
        i += 1 if "=" in argv[i] else 2
    if i < len(argv) and argv[i] in JOB_COMMANDS:
        return [argv[i], *argv[:i], *argv[i + 1 :]]
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if job_argv(argv):
        return job_command(job_argv(argv))
    args, command = parse_args(argv)
    try:
        subs = plan(command, args.sweep, args.run_root, args.name)
        if not args.no_check:
            for s in subs:
                check_overrides(s.command)
        env = runtime_env(Path(args.working_dir).resolve(), Path(args.runtime_env))
    except SubmitError as exc:
        print(f"es-submit: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.dry_run:
        print_upload(env)
        for s in subs:
            print(f"{s.submission_id}\t{s.run_dir or '-'}\t{s.entrypoint}")
        return
    client = connect_jobs(args.address)  # an unreachable address is its one line, before the listing
    print_upload(env)  # what is about to be uploaded, before the first job sends it
    with job_server(args.address):
        for s in subs:
            client.submit_job(
                entrypoint=s.entrypoint,
                submission_id=s.submission_id,
                runtime_env=env,
                metadata={"command": s.entrypoint, **s.metadata},
            )
            print(f"submitted {s.submission_id}" + (f"  run dir {s.run_dir}" if s.run_dir else ""))
            print(follow_hint(args.address, s.submission_id), flush=True)
    if not args.wait:
        return
    try:
        with job_server(args.address):
            statuses = wait_all(client, [s.submission_id for s in subs], stream=len(subs) == 1)
    except KeyboardInterrupt:
        print(
            f"\nes-submit: stopped waiting; the job(s) keep running (es-submit stop --address {args.address} "
            "JOB stops one)",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    if len(subs) > 1:
        print(f"es-submit: {sum(v == 'SUCCEEDED' for v in statuses.values())} of {len(subs)} jobs SUCCEEDED")
    raise SystemExit(0 if all(v == "SUCCEEDED" for v in statuses.values()) else 1)


if __name__ == "__main__":
    main()
