"""The documentation cannot drift from the code: the README and every page under ``docs/``
are read here, and what they show a user is run or checked.

* Every ```` ```python ```` block runs, on 8 CPU devices, in one child process: the blocks of
  a page in order, in one namespace (a page reads as one script). A fragment that cannot run
  alone (``MyNNXModel``, ``my_attention``) carries the line ``<!-- no-run -->`` right before its
  fence, which Markdown and MkDocs render as nothing (``docs/contributing.md``).
* Every ```` ```bash ```` line that runs ``jzero`` parses with the real argument parser (its
  subcommand and flags exist, its values convert), ``jzero launch``'s command included; every
  ``make`` target exists in the Makefile; every script under ``examples/`` or ``benchmarks/``
  that a line runs exists.
* Every ```` ```yaml ```` block loads with :func:`jzero.load_config`.
* "Coming from DeepSpeed" names every key the config code knows, each in the section of the
  page that its config section has (so a new key, or a new alias, fails here until it is
  documented), and every optimizer and schedule with its parameters.
* The README stays a first page: at most 300 lines, ``make demo`` and ``make test`` first, its
  relative links pointing at files that exist.
"""

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import typing
import warnings

import pytest
import yaml
from procs import device_env
from repo import ROOT, SUPPORT

import jzero
from jzero.cli import build_parser
from jzero.config import OPTIMIZER_PARAMS, SCHEDULER_PARAMS, Config, ConfigError, load_config

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
NO_RUN = "<!-- no-run -->"
FENCE = re.compile(r"^(\s*)```(\w*)")


def blocks(path):
    """``(language, first line number, code, runs)`` of each fenced block of a page."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i + 1
        prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith(indent + "```"):
            body.append(lines[i][len(indent) :])
            i += 1
        found.append((lang, start + 1, "\n".join(body) + "\n", prev != NO_RUN))
        i += 1
    return found


def name(path):
    return str(path.relative_to(ROOT))


def test_every_python_block_runs(tmp_path):
    pages = []
    for path in PAGES:
        code = [
            [line, text] for lang, line, text, runs in blocks(path) if lang == "python" and runs
        ]
        if code:
            pages.append([name(path), code])
    assert len(pages) >= 4, pages  # the README, getting started and the guides' examples
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps(pages))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    proc = subprocess.run(
        [sys.executable, str(SUPPORT / "docs_blocks_child.py"), str(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=device_env(8, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == len(pages), proc.stdout


def commands(code):
    """Each command line of a bash block: continuations joined, comments dropped, split on
    ``&&`` and ``;``, leading ``VAR=value`` assignments removed."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd = []
        for word in [*words, ";"]:
            if word in ("&&", ";", "||"):
                while cmd and re.fullmatch(r"[A-Z_]+=.*", cmd[0]):
                    cmd.pop(0)
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(word)


def check_jzero(args, where):
    """``jzero ARGS`` parses with the real parser; under ``launch``, its command too."""
    try:
        parsed = build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `jzero {shlex.join(args)}` does not parse (see the error above)")
    inner = [w for w in getattr(parsed, "command", None) or [] if w != "--"]
    if inner and inner[0].endswith("jzero"):
        check_jzero(inner[1:], where)


MAKE_TARGETS = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("path", PAGES, ids=name)
def test_every_shell_line_names_what_exists(path):
    for lang, line, code, _ in blocks(path):
        if lang not in ("bash", "sh", "console"):
            continue
        for cmd in commands(code):
            where = f"{name(path)}:{line}"
            if cmd[0].endswith("jzero"):
                check_jzero(cmd[1:], where)
            elif cmd[0] == "make":
                targets = [w for w in cmd[1:] if "=" not in w and not w.startswith("-")]
                assert set(targets) <= MAKE_TARGETS, f"{where}: {cmd} ({sorted(MAKE_TARGETS)})"
            for word in cmd[1:]:
                if re.fullmatch(r"(examples|benchmarks)/[\w/.-]+\.(py|sh)", word):
                    assert (ROOT / word).is_file(), f"{where}: {word} does not exist"


def test_the_check_refuses_a_flag_that_does_not_exist():
    check_jzero(["checkpoint", "export", "d", "--out", "m.safetensors"], "here")
    with pytest.raises(pytest.fail.Exception):
        check_jzero(["checkpoint", "export", "d", "--out", "m", "--shard", "5GB"], "here")
    with pytest.raises(pytest.fail.Exception):
        check_jzero(["launch", "-n", "2", "--", "jzero", "train", "c.yaml", "--stage", "3"], "h")


@pytest.mark.parametrize("path", PAGES, ids=name)
def test_every_yaml_block_loads(path):
    for lang, line, code, runs in blocks(path):
        if lang != "yaml" or not runs:
            continue
        raw = yaml.safe_load(code)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load_config(raw)
            except ConfigError as e:
                pytest.fail(f"{name(path)}:{line}: {e}")


def config_keys():
    """``(section, key)`` of every key the config's dataclasses have (section ``""`` is the top
    level), with the two offload sections as one: they share their keys."""
    keys = []

    def walk(cls, section):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("internal") or f.metadata.get("rest"):
                continue
            key = f.metadata.get("key", f.name)
            keys.append((section, key))
            tp = hints[f.name]
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            sub = tp if dataclasses.is_dataclass(tp) else (args[0] if len(args) == 1 else None)
            if sub is not None and dataclasses.is_dataclass(sub):
                walk(sub, f"{section}.{key}" if section else key)

    walk(Config, "")
    return keys


def section_keys(section):
    """The keys of a section that is a plain mapping (``pipeline`` ...), from the error the
    config gives for an unknown one, which lists them."""
    with pytest.raises(ConfigError) as e:
        load_config({section: {"no_such_key": 1}})
    listed = re.search(rf"{section}: unknown key\(s\) .*; the keys are \[(.*?)\]", str(e.value))
    return [k.strip(" '") for k in listed.group(1).split(",")]


def page_sections(text):
    """Heading -> the text under it, down to the next heading of any level."""
    parts = re.split(r"^(#{2,4} .*)$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_coming_from_deepspeed_names_every_key():
    from jzero.config._validate import _OFFLOAD_ALIASES, _PIN_ALIAS, _ZERO_ALIASES

    text = (ROOT / "docs" / "deepspeed.md").read_text()
    sections = page_sections(text)

    def under(section):
        """The text of every heading that names the section in backticks."""
        if section == "":
            return "".join(body for head, body in sections.items() if "Top-level keys" in head)
        names = {section}
        if section in ("zero_optimization.offload_optimizer", "zero_optimization.offload_param"):
            names = {"zero_optimization.offload_optimizer", "zero_optimization.offload_param"}
        return "".join(
            body for head, body in sections.items() if any(f"`{n}`" in head for n in names)
        )

    missing = [f"{s or '(top level)'}: {k}" for s, k in config_keys() if f"`{k}`" not in under(s)]
    for section in ("pipeline", "tensor_parallel", "expert_parallel"):
        missing += [
            f"{section}: {k}" for k in section_keys(section) if f"`{k}`" not in under(section)
        ]
    opt, sched = under("optimizer"), under("scheduler")
    for table, body in ((OPTIMIZER_PARAMS, opt), (SCHEDULER_PARAMS, sched)):
        for kind, params in table.items():
            row = next(
                (r for r in body.splitlines() if r.lower().startswith(f"| `{kind.lower()}`")), ""
            )
            missing += [f"{kind}: {p}" for p in params if f"`{p}`" not in row]
            if not row:
                missing.append(f"{kind}: no row")
    aliases = [*_ZERO_ALIASES, *_OFFLOAD_ALIASES, _PIN_ALIAS]
    missing += [f"alias {a}" for a in aliases if f"`{a}`" not in text]
    assert missing == [], "docs/deepspeed.md lacks: " + ", ".join(missing)


def test_the_key_list_knows_sections_aliases_and_nested_keys():
    keys = config_keys()
    assert ("zero_optimization.offload_optimizer", "nvme_path") in keys
    assert ("checkpoint", "async") in keys and ("", "auto") not in keys
    assert "autoep_size" in section_keys("expert_parallel")


def test_the_readme_is_a_first_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    first = next(code for lang, _, code, _ in blocks(README) if lang == "bash")
    assert first.splitlines()[0].startswith("make demo")
    assert first.splitlines()[1].startswith("make test")
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+:", link):
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"
    assert jzero.__version__
