"""The README's code blocks run as pasted: each Python block in a fresh interpreter as a user
on this machine would run it (no TRITON_INTERPRET: on a CPU, PyTorch's math), each shell
transcript's ``timm-flashwin`` command parses as shown, and the ``list`` transcript's rows
are what ``list`` prints."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from timm_flashwin.tools import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)
PYTHON = [code for language, code in BLOCKS if language == "python"]


def test_the_readme_has_the_blocks_these_tests_read():
    assert len(PYTHON) == 2 and "patch_model(model)" in PYTHON[0] and "sliding_window_attention(q" in PYTHON[1]
    assert sum(1 for language, code in BLOCKS if language == "" and "$ timm-flashwin" in code) == 2


@pytest.mark.parametrize("code", PYTHON, ids=["quick-start", "local-attention"])
def test_python_blocks_run_as_pasted(code):
    """As pasted into a fresh interpreter: no name left undefined (the Quick start used an
    ``other_model`` it never made), the printed report says what computes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    if "patch_report" in code:
        assert "attention computed by " in result.stdout and "patched 12 of 12" in result.stdout, result.stdout


def _commands():
    """Each ``$ timm-flashwin ...`` (or ``-m timm_flashwin ...``) line of the transcripts, as argv."""
    for language, code in BLOCKS:
        for line in code.splitlines():
            if line.startswith("$ ") and ("timm-flashwin " in line or "-m timm_flashwin " in line):
                words = shlex.split(line[2:].split("  #")[0])
                start = words.index("timm-flashwin") if "timm-flashwin" in words else words.index("timm_flashwin")
                yield [w for w in words[start + 1:] if w != "..."]


def test_transcript_commands_parse_as_shown():
    """Every option a transcript shows exists (parsed by the command line's own parser; run's
    own options before its script)."""
    from timm_flashwin.tools.runner import split_argv
    commands = list(_commands())
    assert {argv[0] for argv in commands} == {"run", "list", "verify", "bench"}
    parser = cli._parser()
    for argv in commands:
        if argv[0] == "run":
            own, target = split_argv(argv[1:])
            assert target is not None and cli._parse(parser, ["run", *own]).command == "run"
        else:
            assert cli._parse(parser, argv).command == argv[0], argv


def test_the_list_transcript_is_what_list_prints(capsys):
    block = next(code for language, code in BLOCKS if "$ timm-flashwin list" in code)
    argv = shlex.split(block.splitlines()[0][2:])[1:]
    shown = [[cell.strip() for cell in line.strip("│").split("│")] for line in block.splitlines() if
             line.startswith("│") and "swinv2" in line]
    assert cli.main(argv) == 0
    printed = [[cell.strip() for cell in line.strip("│").split("│")] for line in capsys.readouterr().out.splitlines()
               if line.startswith("│")]
    assert shown and printed == shown
