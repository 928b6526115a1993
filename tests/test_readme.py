"""README's commands agree with each other and with the scripts they describe: read from the files
themselves, so that an edit to one without the other fails here."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def readme_commands() -> list[list[str]]:
    """Every command of README's ```bash blocks, continuation lines joined and comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def flag_values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]


def is_placeholder(path: str) -> bool:
    """DIR, RUN, $SCRATCH/...: a path the reader substitutes, not one README prepares."""
    return "$" in path or path.isupper()


def test_every_data_dir_in_readme_is_prepared_by_a_readme_command():
    prepared, used = set(), []  # used: (directory, the command that reads it)
    for words in readme_commands():
        if "data_prep" in words and "verify" in words:
            used.append((words[words.index("verify") + 1], " ".join(words)))
        elif "data_prep" in words:
            prepared |= set(flag_values(words, "--out"))
        used += [(d, " ".join(words)) for d in flag_values(words, "--data-dir")]
    assert {"data/shakespeare", "data/fineweb10B"} <= prepared  # the names the training commands use
    assert len(used) >= 8  # the training, SLURM and eval commands were found
    unprepared = [(d, cmd) for d, cmd in used if d not in prepared and not is_placeholder(d)]
    assert unprepared == [], f"README trains on directories it never prepares: {unprepared}"


def test_the_quick_start_environment_draws_the_loss_curve():
    """README promises RUN/loss_curve.png; matplotlib is the plot extra, which quickstart.sh asks for
    (or finds already there, as the dev extra installs it too)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert any(d.startswith("matplotlib") for d in extras["dev"])  # the branch that skips the extra
    script = (REPO / "scripts" / "quickstart.sh").read_text()
    assert re.search(r"^\s*bash scripts/setup\.sh plot$", script, flags=re.M)
    assert 'import matplotlib' in script
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "loss_curve.png" in quick_start and "`plot` extra" in quick_start


def test_install_gives_the_cpu_build_of_torch():
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    pip = [w for w in readme_commands() if w[:3] == ["pip", "install", "torch==2.13.0"]]
    assert pip and flag_values(pip[0], "--index-url") == ["https://download.pytorch.org/whl/cpu"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
