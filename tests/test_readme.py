"""The documentation's commands (README.md and docs/*.md) agree with each other and with the scripts they
describe: read from the files themselves, so that an edit to one without the other fails here. README
stays a guide read in one sitting, and every link in the documentation resolves."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from _helpers import guide_commands, guide_pages

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def readme_commands() -> list[list[str]]:
    """Every command of the documentation's ```bash blocks (README.md and docs/*.md)."""
    return guide_commands()


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
        used += [(d, " ".join(words)) for v in flag_values(words, "--data-dir") for d in v.split(",")]  # a mixture
    assert {"data/shakespeare", "data/fineweb10B"} <= prepared  # the names the training commands use
    assert len(used) >= 8  # the training, SLURM and eval commands were found
    unprepared = [(d, cmd) for d, cmd in used if d not in prepared and not is_placeholder(d)]
    assert unprepared == [], f"the docs train on directories it never prepares: {unprepared}"


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
    assert "import matplotlib" in script
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "loss_curve.png" in quick_start and "`plot` extra" in quick_start


def test_install_gives_the_cpu_build_of_torch():
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    pip = [w for w in readme_commands() if w[:3] == ["pip", "install", "torch==2.13.0"]]
    assert pip and flag_values(pip[0], "--index-url") == ["https://download.pytorch.org/whl/cpu"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install


def test_readme_is_a_guide_read_in_one_sitting():
    """At most 300 lines; outside code blocks no line over 110 characters."""
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference material to docs/"
    long, in_code = [], False
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and len(line) > 110:
            long.append((number, len(line)))
    assert long == [], f"README.md lines over 110 characters (line, length): {long}"


def test_readme_says_to_activate_the_environment_right_after_the_first_commands():
    """Every later command is a bare python/torchrun: without the activate line they miss the packages."""
    first = README.split("## First commands", 1)[1].split("\n## ", 1)[0]
    assert "bash scripts/quickstart.sh" in first and "bash scripts/setup.sh dev" in first
    assert "source .venv/bin/activate" in first
    assert first.index("bash scripts/quickstart.sh") < first.index("source .venv/bin/activate")


def test_readme_links_every_docs_page():
    pages = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))
    assert pages, "docs/ has no pages"
    linked = set(re.findall(r"\]\(([^)#\s]+)", README))
    assert [p for p in pages if p not in linked] == []


def test_every_relative_link_in_the_documentation_resolves():
    broken = []
    for page in [*guide_pages(), REPO / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z]+:", path):  # an anchor in the page itself, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []


def test_every_preset_has_a_command_in_the_readme():
    """Every --preset (the model shapes and the recipes without a shape of their own, finetune) has a
    train_ddp.py command in README that runs it."""
    from gpt2.core.config import MODEL_PRESETS, TRAIN_PRESETS

    presets = {
        words[words.index("--preset") + 1]
        for words in readme_commands()
        if "--preset" in words and "train_ddp.py" in words and words[0] != "sbatch"
    }
    assert sorted(set(MODEL_PRESETS) | set(TRAIN_PRESETS)) == sorted(presets)


def test_the_walkthrough_starts_several_processes_with_the_quiet_launcher():
    """Under plain torchrun a failing rank's one `error:` line is line 5 of torchrun's 44-line block; the
    walkthrough (and the quick start it follows) use python -m gpt2.launch, which prints three lines instead."""
    walkthrough = README.split("## Walkthrough", 1)[1].split("\n## ", 1)[0]
    commands = [
        shlex.split(line, comments=True)
        for block in re.findall(r"```bash\n(.*?)```", walkthrough, re.S)
        for line in block.replace("\\\n", " ").splitlines()
    ]
    launches = [words for words in commands if any(w.startswith("--nproc_per_node") for w in words)]
    assert launches and all(words[:3] == ["python", "-m", "gpt2.launch"] for words in launches), launches
    script = (REPO / "scripts" / "quickstart.sh").read_text()
    assert '"$PYTHON" -m gpt2.launch --standalone --nproc_per_node="$NPROC" train_ddp.py' in script
    assert "torch.distributed.run" not in script


def test_the_suite_needs_nothing_beside_the_clone():
    """A fresh clone runs README's test command alone (issue 78): the corpus the tests train on is a tracked file
    of this repository, and no test reaches outside it for data; where CI has ../shared/data beside the clone,
    it holds the same bytes, so CI and a user's clone test the same thing."""
    import hashlib
    import subprocess

    from conftest import REPO, SHAKESPEARE

    assert REPO in SHAKESPEARE.resolve().parents, SHAKESPEARE
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", str(SHAKESPEARE.relative_to(REPO))], cwd=REPO, capture_output=True
    )
    assert tracked.returncode == 0 or not (REPO / ".git").exists(), "tests/data/tinyshakespeare.txt is not tracked"
    outside = " / ".join(['"shared"', '"data"'])  # how conftest.py named ../shared/data before
    for path in sorted((REPO / "tests").rglob("*.py")):
        assert outside not in path.read_text(), f"{path} reads ../shared/data: ship what it needs"
    beside = REPO.parent.joinpath("shared", "data", SHAKESPEARE.name)
    if beside.is_file():
        digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (SHAKESPEARE, beside)]
        assert digest[0] == digest[1], f"{SHAKESPEARE} and {beside} differ"
