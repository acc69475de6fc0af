"""The markdown view of the GPU check's report (``report.json`` holds every figure)."""

from __future__ import annotations

from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table; floats with three significant digits, None as a dash."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


def render_markdown(report: dict[str, Any]) -> str:
    parts: dict[str, dict[str, Any]] = report.get("parts", {})
    out = [f"# {report.get('check', 'GPU check')}", "",
           f"Dry run: {'yes (CPU, tiny sizes)' if report.get('dry_run') else 'no'}; started {report.get('started')}; "
           f"elapsed {report.get('elapsed_s', '-')} s of a budget of {report.get('budget_s') or 'none'}; "
           f"CPU {report.get('cpu_s', '-')} s; load {report.get('load_at_start')} -> {report.get('load_at_end', '-')}.",
           ""]
    out += table(["part", "status", "wall s", "CPU s", "what"],
                 [[n, r.get("status"), r.get("wall_s"), r.get("cpu_s"), r.get("what", "")] for n, r in parts.items()])
    for name, rec in parts.items():
        out += ["", f"## {name}: {rec.get('status')}", ""]
        out += list(rec.get("summary") or [])
        if rec.get("error"):
            out += ["", f"**Error**: {rec['error']}"]
        if rec.get("skipped"):
            out += ["", "Not run here:"] + [f"- `{k}`: {v}" for k, v in rec["skipped"].items()]
        if rec.get("notes"):
            out += ["", "Notes:"] + [f"- {n}" for n in rec["notes"]]
        if rec.get("log_tail"):
            out += ["", "Log tail:", "```", rec["log_tail"][-1500:], "```"]
    wheels = report.get("wheels")
    if wheels:
        out += ["", "## wheels", "",
                f"Distributions imported: {len(wheels['imported'])}; from the carried wheels: "
                f"{', '.join(wheels['from_wheels']) or 'none'}; in neither the image nor the wheels: "
                f"{', '.join(wheels['missing']) or 'none'}."]
    return "\n".join(out) + "\n"
