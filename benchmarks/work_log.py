"""Where benchmark scripts record a run: the day's file of the work log, benchmarks/history/.

`benchmarks/RESULTS.md` is the summary (the latest figure of each benchmark, written by hand
from the log); a script that records its table appends it here instead, and says where.
"""

from __future__ import annotations

import datetime
from pathlib import Path

HISTORY = Path(__file__).resolve().parent / "history"


def append_to_work_log(text: str) -> Path:
    """Append ``text`` to today's work-log file (created with a heading) and return its path."""
    today = datetime.date.today().isoformat()
    existing = sorted(HISTORY.glob(f"*-{today}.md"))
    path = existing[-1] if existing else HISTORY / f"{len(list(HISTORY.glob('[0-9]*.md'))) + 1:02d}-{today}.md"
    if not path.exists():
        path.write_text(f"# Session of {today}\n")
    with path.open("a") as f:
        f.write(text if text.startswith("\n") else "\n" + text)
    print(f"appended to {path} (the work log); update benchmarks/RESULTS.md's summary by hand")
    return path
