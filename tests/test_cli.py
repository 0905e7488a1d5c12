"""The command line answers at once (issue 29, item 4): building the parser
of every subcommand imports neither torch nor LMCache (their imports took
8.5 s of every call, ``--help`` included), every subcommand's help comes
back without them, an option's default is in its help, and LMCache prints
nothing below the level the user chose.

Each check runs a fresh interpreter: this one has torch loaded already."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_tiered.cli import COMMANDS

HEAVY = ("torch", "lmcache", "transformers", "numpy", "matplotlib", "vllm")


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "LMCACHE_LOG_LEVEL"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment | env,
    )


def test_the_parser_of_every_subcommand_imports_nothing_heavy() -> None:
    done = python(
        "import sys\n"
        "from lmcache_tiered.cli import build_parser\n"
        "build_parser()\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_lmcache_loggers_made_while_parsing_take_the_chosen_level() -> None:
    """LMCache's loggers take LMCACHE_LOG_LEVEL when they are made, and an
    option's type may import LMCache (the bench's --warm-drive does): main
    sets the level before parsing, or every bench run printed an INFO line."""
    code = (
        "import logging\n"
        "from lmcache_tiered.cli import main\n"
        "try:\n"
        "    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "made = [\n"
        "    log.level for log in logging.root.manager.loggerDict.values()\n"
        "    if isinstance(log, logging.Logger) and log.name.startswith('lmcache.')\n"
        "    and log.level\n"
        "]\n"
        "print(len(made), min(made))"
    )
    argv = ["bench", "--warm-drive", "1.3,0.5", "--help"]
    quiet = python(code.format(argv=argv))
    assert quiet.returncode == 0, quiet.stderr
    made, lowest = map(int, quiet.stdout.split()[-2:])
    assert made > 0 and lowest == logging.WARNING
    loud = python(code.format(argv=["-v", *argv]))
    assert int(loud.stdout.split()[-1]) == logging.INFO


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_answers_without_torch_or_lmcache(command: str) -> None:
    argv = [command, "--help"] if command else ["--help"]
    done = python(
        "import sys\n"
        "from lmcache_tiered.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        f"heavy = {{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})\n"
        "print('exit', code, sorted(heavy))"
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.splitlines()[-1] == "exit 0 []"
    assert "usage: lmcache-tiered" in done.stdout


def test_an_option_with_a_default_says_it_in_its_help() -> None:
    done = python("from lmcache_tiered.cli import main\nmain(['diskbench', '--help'])")
    text = " ".join(done.stdout.split())  # argparse wraps lines
    assert "ring (tiered.queue_depth) (default: 64)" in text
    assert "(default: 2)" in text and "--mp also measure" in text  # flags: none
    demo = python("from lmcache_tiered.cli import main\nmain(['demo', '--help'])")
    assert "first prompt's seed (one per prompt) (default: 0)" in " ".join(
        demo.stdout.split()
    )  # a default of 0 is said, not taken for a flag's False


def test_lmcache_says_nothing_below_the_chosen_level(tmp_path: Path) -> None:
    """A run that imports LMCache (inspect reads keys through it; here it
    finds no tier files, exit 2) prints no LMCache INFO line at the default
    level, and does with --verbose."""
    code = "from lmcache_tiered.cli import main\nraise SystemExit(main({argv!r}))"
    quiet = python(code.format(argv=["inspect", str(tmp_path)]))
    assert quiet.returncode == 2 and "no tier files" in quiet.stderr
    assert "LMCache INFO" not in quiet.stderr
    loud = python(code.format(argv=["-v", "inspect", str(tmp_path)]))
    assert loud.returncode == 2 and "LMCache INFO" in loud.stderr
