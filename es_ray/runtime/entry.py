"""The Hydra entry point every console script uses, and its error handling.

A user's mistake (a bad setting, a missing model or dataset, an unreachable cluster) is one line on stderr that
names what to change, and exit code 2; never a traceback.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

from es_ray.core.config import ConfigError
from es_ray.core.config_docs import field_docs
from es_ray.models import ModelNotFoundError
from es_ray.tasks.base import TaskLoadError

# Hydra and OmegaConf are imported inside the entry point's functions: a module that imports the error handling
# (run_or_exit) loads no Hydra.


def _conf_dir() -> Path:
    """The Hydra presets: es_ray/conf in an installed wheel (setup.py ships conf/ there), else conf/ at the top of
    the source checkout (an editable install)."""
    here = Path(__file__).resolve().parents[1] / "conf"
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "conf"


CONF_DIR = _conf_dir()


def user_errors() -> tuple[type[BaseException], ...]:
    return ConfigError, ModelNotFoundError, TaskLoadError


def run_or_exit(prog: str, fn: Callable[[], Any]) -> Any:
    """``fn()``; a user error becomes one line on stderr and exit code 2. One raised in an actor (a resumed
    checkpoint the learner refuses) comes as Ray's RayTaskError, an instance of its class too, whose text is the
    actor's traceback: its ``cause`` is the error as raised, and its line is the one shown."""
    try:
        return fn()
    except user_errors() as exc:
        err = getattr(exc, "cause", None) or exc
        print(f"{prog}: {type(err).__name__}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


TRAINING_RUN_KEYS = (
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.resume",
    "run.stop_at_tokens",
    "run.stop_at_device_seconds",
)
"""The keys of the shared run section that only a trainer reads: es-eval's and es-drift's --help leave them out."""
HELP_FLAGS = frozenset({"--help", "-h"})


def hydra_main(
    config_name: str, fn: Callable[[Any], None], prog: str, register: Callable[[], None], unread: tuple[str, ...] = ()
) -> None:
    """Run ``fn(composed DictConfig)`` as a Hydra application over conf/<config_name>.yaml, after ``register()``
    has stored the entry point's schema in Hydra's ConfigStore. ``--help`` (after overrides too) lists the presets
    that compose with this entry point and every key it reads (``unread``: keys of its schema it never reads) with
    its value and what it does."""
    import hydra

    register()
    if not CONF_DIR.is_dir():
        raise SystemExit(
            f"{prog}: Hydra presets not found at {CONF_DIR}; reinstall the project (`pip install .`, or "
            "`pip install -e .` in a checkout)"
        )
    args = sys.argv[1:]
    if HELP_FLAGS & set(args) and not any(a.startswith("-") for a in args if a not in HELP_FLAGS):
        overrides = [a for a in args if a not in HELP_FLAGS]
        problem = check_overrides(config_name, overrides) if overrides else None
        if problem:
            exit_with(prog, problem)
        print(help_text(prog, config_name, overrides, unread))
        return
    if MULTIRUN_FLAGS & set(args):
        exit_with(
            prog,
            "-m/--multirun is not supported: the jobs would share one run.dir and run one after another. "
            f"Sweep with `es-submit --sweep es.sigma=1e-3,2e-3 -- {prog} ...` (one job and run dir per "
            "value; docs/running.md), or start one command per value",
        )
    plain = without_cfg_flags(args)  # `--cfg job` (es-submit's local check) gets the same one-line errors
    if not any(a.startswith("-") for a in plain):  # Hydra's other flags (--info, ...) go to Hydra unchecked
        problem = check_overrides(config_name, plain)
        if problem:
            exit_with(prog, problem)
    hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(fn)()


MULTIRUN_FLAGS = frozenset({"-m", "--multirun"})


def without_cfg_flags(args: list[str]) -> list[str]:
    """``args`` without Hydra's config-printing flags: ``--cfg``/``-c`` and the part it names, ``--resolve``."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--cfg", "-c"):
            skip = True
        elif a != "--resolve":
            out.append(a)
    return out


def exit_with(prog: str, message: str) -> None:
    """One line on stderr, exit code 2 (a user's mistake)."""
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(2)


def known_keys(cfg: Any) -> set[str]:
    """Every dotted key of a composed config, inner nodes included."""
    from omegaconf import DictConfig

    out = set()
    for k, v in cfg.items():
        out.add(str(k))
        if isinstance(v, DictConfig):
            out |= {f"{k}.{sub}" for sub in known_keys(v)}
    return out


SECTIONS = {
    "es_train": ("model", "task", "es", "sampling", "engine", "cluster", "eval", "run", "faults"),
    "grpo_train": ("model", "task", "grpo", "sampling", "engine", "cluster", "eval", "run", "faults"),
    "es_eval": ("model", "eval", "engine", "cluster", "run", "faults"),
    "es_drift": ("base", "tuned", "thresholds", "cast_dtype", "top", "run"),
    "es_interpolate": ("a", "b", "base", "grid", "draws", "eval", "engine", "run"),
    "es_compare": (
        "model",
        "task",
        "es",
        "es_sampling",
        "grpo",
        "grpo_sampling",
        "budget",
        "methods",
        "seeds",
        "eval",
        "drift_thresholds",
        "engine",
        "cluster",
        "curve_every",
        "grpo_rollout_actors",
        "run",
        "faults",
        "sequence",
        "interpolate",
        "verdict",
        "sensitivity",
        "from_run",
    ),
}
"""Each entry point's top-level keys (its schema's fields; tests/runtime/test_hints.py keeps them equal), so an
override of another entry point's section says whose it is."""
SECTION_INSTEAD = {
    ("es_eval", "task"): "it scores eval.tasks=[...], each read from eval.paths.<task>= or eval.data_dir=",
    ("es_eval", "sampling"): "its sampling keys are eval.temperature, eval.top_p, eval.max_new_tokens and eval.n",
}
"""A section a user carries over from a trainer to an entry point that has its own keys for it."""


def unknown_key_hint(key: str, known: set[str], groups: set[str], config_name: str) -> str:
    """What to write instead of an unknown ``key``: the closest key of its own section (es.popualtion ->
    es.population); for a section this command does not have, the commands that have it (es.population given to
    grpo-train is es-train's), never a look-alike from an unrelated section; else the closest key of any section.
    Call inside Hydra's initialize_config_dir (it composes the other entry points' configs)."""
    section = key.split(".")[0]
    prog = config_name.replace("_", "-")
    tail = f"(`{prog} --help` lists every key and preset)"
    parts = key.split(".")
    parent = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in known), None)
    if parent and not any(k.startswith(parent + ".") for k in known):  # a map with no entries yet (eval.paths)
        return f"{parent} is a map whose entries are new keys: write +{key}=... (with the +); {tail}"
    if "." in key and section in known:
        same = sorted(k for k in known if k.startswith(section + "."))
        close = difflib.get_close_matches(key, same, n=1, cutoff=0.6)
        return f"did you mean {close[0]}? {tail}" if close else f"{section} has no such key; {tail}"
    if (config_name, section) in SECTION_INSTEAD:
        return f"{prog} has no {section} section: {SECTION_INSTEAD[config_name, section]}; {tail}"
    owners = [name.replace("_", "-") for name, sections in SECTIONS.items() if section in sections]
    if "." in key and section not in groups and owners:
        return f"{section}.* is a section of {', '.join(owners)}, not of {prog}; {tail}"
    close = difflib.get_close_matches(key, sorted(known | groups), n=1, cutoff=0.6)
    return f"did you mean {close[0]}? {tail}" if close else f"no key is close to it; {tail}"


def check_overrides(config_name: str, args: list[str]) -> str | None:
    """What Hydra would refuse in ``args`` (key=value overrides and group=option presets), as one line naming the
    key: a syntax error, an unknown key (with the closest known one), a preset that does not exist, a value of the
    wrong type. None when they compose."""

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    ours = [a for a in args if not a.lstrip("+~").startswith("hydra.")]
    try:
        overrides = OverridesParser.create().parse_overrides(ours)
    except HydraException as exc:
        bad = next((a for a in ours if _unparsable(a)), " ".join(ours))
        return f"cannot read the override {bad!r}: {_first_line(exc)} (write key=value, lists as key=[a,b])"
    groups = {p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in CONF_DIR.iterdir() if p.is_dir()}
    for o in overrides:  # an optional group (experiment) composes without a preset that does not exist
        if (
            o.key_or_group in groups
            and not o.is_add()
            and not isinstance(o.value(), (list, dict))
            and o.value() is not None
            and str(o.value()) not in groups[o.key_or_group]
        ):
            return f"{o.key_or_group}={o.value()}: no such preset; choose one of {', '.join(groups[o.key_or_group])}"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        # the common case first: overrides that compose need no diagnosis (one compose, not two, per command;
        # the schema is structured, so an unknown key fails this compose too)
        try:
            compose(config_name=config_name, overrides=ours)
            return None
        except (HydraException, OmegaConfBaseException):
            pass
        known = known_keys(compose(config_name=config_name))
        for text, o in zip(ours, overrides):
            key = o.key_or_group
            if key in groups and not o.is_add() and not isinstance(o.value(), (list, dict)):
                continue  # a preset, checked above
            if o.is_add() or o.is_delete() or key in known:
                continue
            return f"unknown key {key} in {text!r}: {unknown_key_hint(key, known, set(groups), config_name)}"
        try:
            compose(config_name=config_name, overrides=ours)
        except (HydraException, OmegaConfBaseException) as exc:
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            culprit = next(
                (
                    t
                    for t, o in zip(ours, overrides)
                    if f"override {t}" in str(exc) or f"'{o.key_or_group}/{o.value()}'" in str(exc)
                ),
                None,
            )
            culprit = culprit or _full_key(cause) or ""
            what = _one_line(cause)
            if culprit and "=" in culprit and culprit.split("=")[0] in groups:
                what += "; the preset is not for this command (`--help` lists those that are)"
            if "ListConfig" in what:
                what += " (a list is written key=[a,b])"
            return f"{culprit}: {what}" if culprit else what
    return None


def _unparsable(text: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        OverridesParser.create().parse_override(text)
    except HydraException:
        return True
    return False


def _one_line(exc: BaseException) -> str:
    """Hydra's message without its indented details, its 'where' preamble and its pointers to docs."""
    lines = [
        line.strip()
        for line in str(exc).splitlines()
        if line.strip()
        and not line[0].isspace()
        and "HYDRA_FULL_ERROR" not in line
        and not line.startswith(("See https", "Error merging override", "Could not override"))
    ]
    text = re.sub(r"In '[^']*': \w+ raised while composing config:\s*", "", " ".join(lines)).strip()
    return text or type(exc).__name__


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _full_key(exc: BaseException) -> str | None:
    return getattr(exc, "full_key", None)


def composable_presets(config_name: str) -> dict[str, list[str]]:
    """Every preset group under conf/ with the options that compose with this entry point's schema (the schema
    must be registered): experiment presets are written for one entry point or another, and Hydra's own help
    would list them all."""
    from hydra import compose, initialize_config_dir

    out = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
            ok = []
            for option in sorted(f.stem for f in group.glob("*.yaml")):
                for override in (f"{group.name}={option}", f"+{group.name}={option}"):
                    try:
                        compose(config_name=config_name, overrides=[override])
                    except Exception:  # noqa: BLE001 - a preset for another entry point, or a group this one lacks
                        continue
                    ok.append(option)
                    break
            if ok:
                out[group.name] = ok
    return out


def help_text(
    prog: str, config_name: str, overrides: list[str] | tuple[str, ...] = (), unread: tuple[str, ...] = ()
) -> str:
    """The presets that compose with this command, then every key it reads with its value after ``overrides`` and
    the docstring under its field (the text docs/config.md shows)."""
    from hydra import compose, initialize_config_dir

    groups = composable_presets(config_name)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    lines = [
        f"{prog}: Hydra application; override any key as key=value, pick presets as group=option.",
        "",
        "== Configuration groups (the presets that compose with this command) ==",
        "",
    ]
    lines += [f"{group}: {', '.join(options)}" for group, options in groups.items()] or ["(none)"]
    given = f" after {' '.join(overrides)}" if overrides else " (defaults)"
    lines += ["", f"== Keys{given}: key=value, then what it does (docs/config.md) ==", ""]
    lines += key_lines(cfg, unread)
    return "\n".join(lines).rstrip() + "\n"


def key_lines(cfg: Any, unread: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """``key=value`` and the field's docstring, indented, for every leaf key of a composed structured config not
    matched by the ``unread`` patterns (fnmatch); a blank line after each section."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(cfg)
    docs = field_docs(schema) if isinstance(schema, type) and schema is not dict else {}
    leaves, sections = [], []
    for key in cfg:
        name = f"{prefix}{key}"
        if any(fnmatch.fnmatchcase(name, p) for p in unread):
            continue
        node = cfg._get_node(key)
        if (
            isinstance(node, DictConfig)
            and isinstance(OmegaConf.get_type(node), type)
            and OmegaConf.get_type(node) is not dict
        ):
            sections += key_lines(node, unread, f"{name}.")
            continue
        value = (
            OmegaConf.to_container(node, resolve=False)
            if isinstance(node, DictConfig) or OmegaConf.is_list(node)
            else node._value()
        )
        leaves.append(f"{name}={_override_text(value)}")
        doc = docs.get(str(key), "")
        if doc:
            leaves += textwrap.wrap(doc, 100, initial_indent="    ", subsequent_indent="    ")
    return ([*leaves, ""] if leaves else []) + sections


def _override_text(value: Any) -> str:
    """A value as it is written on the command line: true/false, null, [a,b], '' for the empty string."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_text(v)}" for k, v in value.items()) + "}"
    return str(value)
