"""The GPU check's report: named checks (PASS, FAIL, WARN, SKIP) per part and the lines printed with them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    part: str
    name: str
    status: str  # PASS, FAIL, WARN, SKIP
    detail: str


class Report:
    def __init__(self) -> None:
        self.checks: list[Check] = []
        self.lines: list[str] = []

    def check(self, part: str, name: str, ok: bool | None, detail: str, *, warn: bool = False,
              skip: str | None = None) -> None:
        """``ok`` True: PASS; False: FAIL (WARN with ``warn``); ``skip``: SKIP with that reason."""
        if skip is not None:
            status = "SKIP"
            detail = f"{skip}; {detail}" if detail else skip
        elif ok:
            status = "PASS"
        else:
            status = "WARN" if warn else "FAIL"
        self.checks.append(Check(part, name, status, detail))

    def missing(self, part: str, name: str, detail: str, *, cut: bool) -> None:
        """A check whose data is missing: a FAIL, or a SKIP when the part was cut by its time budget (that
        is reported once, as a warning naming the part)."""
        self.check(part, name, False, detail, skip="not run: the part was cut by its budget" if cut else None)

    def say(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "FAIL"]
