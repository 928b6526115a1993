"""The node check's results: a section's rows and status, the exit status, the table and the JSON.

A Section collects Rows (info, a note with its own status, or a check that passes or fails); the table
prints one line per row, the JSON keeps the rows and each section's data for tools."""

from __future__ import annotations

import dataclasses
import datetime
import socket
from dataclasses import dataclass, field

import torch

OK, FAILED, NA, WARN, SKIPPED = "ok", "FAILED", "n/a", "WARN", "skipped"
CORRECTNESS_SECTIONS = ("attention", "correctness", "resume")
"""Sections whose failure to run at all also counts as a failed check (exit 1)."""


@dataclass
class Row:
    check: str
    result: str
    status: str = ""


@dataclass
class Section:
    name: str
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    status: str = OK
    reason: str = ""
    """The first failed check, or the error the section stopped with."""
    failed_checks: int = 0
    error: bool = False
    seconds: float = 0.0

    def info(self, check: str, result: str) -> None:
        self.rows.append(Row(check, result))

    def note(self, check: str, result: str, status: str) -> None:
        self.rows.append(Row(check, result, status))

    def check(self, check: str, passed: bool, result: str) -> bool:
        self.rows.append(Row(check, result, OK if passed else FAILED))
        if not passed:
            self.failed_checks += 1
            self.status, self.reason = FAILED, self.reason or f"{check}: {result}"
        return passed

    def fail(self, reason: str) -> None:
        """The section could not finish."""
        self.error, self.status, self.reason = True, FAILED, reason


def exit_status(sections: list[Section]) -> int:
    if any(s.failed_checks or (s.error and s.name in CORRECTNESS_SECTIONS) for s in sections):
        return 1
    return 3 if any(s.error for s in sections) else 0


def format_table(sections: list[Section], header: str) -> str:
    lines = [header, "", "| section | check | result | status |", "|---|---|---|---|"]
    for s in sections:
        rows = s.rows + ([Row("section", s.reason, FAILED)] if s.error else [])
        rows = rows or [Row("section", s.reason or s.status, s.status)]
        for i, r in enumerate(rows):
            name = f"{s.name} ({s.seconds:.0f} s)" if i == 0 else ""
            lines.append(f"| {name} | {r.check} | {_cell(r.result)} | {r.status} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def header_line(device: torch.device, sections: list[Section], wall_s: float, status: int) -> str:
    env = next((s for s in sections if s.name == "environment"), Section("environment"))
    what = next((r.result for r in env.rows if r.check == "devices"), str(device))
    verdict = {0: "all checks passed", 1: "a CHECK FAILED", 3: "a section could not run"}[status]
    return f"gpt2 doctor: {what} | torch {torch.__version__} | {wall_s:.0f} s | exit {status}: {verdict}"


def report_json(sections: list[Section], *, device: torch.device, argv: list[str], wall_s: float, status: int) -> dict:
    return {
        "doctor": 1,
        "command": "python -m gpt2.doctor " + " ".join(argv),
        "device": device.type,
        "host": socket.gethostname(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "wall_s": wall_s,
        "exit_status": status,
        "sections": {
            s.name: {
                "status": s.status,
                "reason": s.reason,
                "seconds": s.seconds,
                "failed_checks": s.failed_checks,
                "error": s.error,
                "rows": [dataclasses.asdict(r) for r in s.rows],
                "data": s.data,
            }
            for s in sections
        },
    }
