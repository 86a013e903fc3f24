"""The ``terminal`` family: shell-agent trajectories in a sandbox with a task checker.

Records are ``{"id", "task", "messages", "tools", "finished", "tests_passed",
"used_in", "meta": {"topic", "defect"}}``. The assistant runs commands through
``execute_command``; outputs are consistent with the final answer, which the
task's checker compares (``tests_passed``). ~11% are planted failures:
``unfinished``, ``tests_failed`` (a wrong final answer) and ``malformed_tool_call``.
"""

from __future__ import annotations

import random

from factory.data.samples.common import (
    TRAJECTORY_DEFECTS,
    assistant,
    break_tool_call,
    plan_defects,
    reasoning_fields,
    tool_call,
    tool_definition,
    tool_result,
    used_in,
)

__all__ = ["terminal"]

TOOLS = [
    tool_definition(
        "execute_command",
        "Run a bash command in the sandbox and return its stdout and stderr.",
        {
            "command": ("string", "The command line"),
            "timeout": ("integer", "Seconds before it is killed"),
        },
        ["command"],
    ),
    tool_definition(
        "write_file",
        "Write text to a file, replacing it if it exists.",
        {"path": ("string", "File path"), "content": ("string", "Full file contents")},
        ["path", "content"],
    ),
]
_DIRS = ("logs", "var/log/tramway", "services/hive/logs", "data/archive", "runs/nightly")
_STEMS = ("api", "worker", "scheduler", "ingest", "billing", "gateway", "mailer", "cron")

Step = tuple[str, str, str]  # (reasoning, command, output)


def _count_errors(r: random.Random) -> tuple[str, list[Step], str, str]:
    d = r.choice(_DIRS)
    files = sorted(f"{s}.log" for s in r.sample(_STEMS, r.randint(2, 5)))
    counts = [r.randint(0, 40) for _ in files]
    total = sum(counts)
    return (
        f"How many lines containing ERROR are there across all .log files in {d}?",
        [
            ("List the log files first.", f"ls {d}", "  ".join(files)),
            (
                "Count ERROR lines per file.",
                f"grep -c ERROR {d}/*.log",
                "\n".join(f"{d}/{f}:{c}" for f, c in zip(files, counts, strict=True)),
            ),
        ],
        str(total),
        f"There are {total} lines containing ERROR across {len(files)} log files in {d}.",
    )


def _largest(r: random.Random) -> tuple[str, list[Step], str, str]:
    d = r.choice(_DIRS)
    sizes = sorted(r.sample(range(3, 900), 4), reverse=True)
    names = [f"{r.choice(_STEMS)}-{r.randint(1, 99):02d}.tar" for _ in sizes]
    listing = "\n".join(f"{s}M\t{d}/{n}" for s, n in zip(sizes, names, strict=True))
    return (
        f"Which file in {d} takes the most disk space?",
        [("Sort the files by size, largest first.", f"du -ah {d} | sort -rh | head -n 4", listing)],
        names[0],
        f"The largest file is {d}/{names[0]} at {sizes[0]}M.",
    )


def _unique_ips(r: random.Random) -> tuple[str, list[Step], str, str]:
    n = r.randint(12, 4000)
    log = f"{r.choice(_DIRS)}/access.log"
    sample = "\n".join(
        f'10.{r.randint(0, 9)}.{r.randint(0, 255)}.{r.randint(1, 254)} - - "GET /{r.choice(_STEMS)} HTTP/1.1" 200'
        for _ in range(3)
    )
    return (
        f"Count the distinct client IP addresses in {log}.",
        [
            ("Look at the format of the log.", f"head -n 3 {log}", sample),
            ("The IP is the first field.", f"awk '{{print $1}}' {log} | sort -u | wc -l", str(n)),
        ],
        str(n),
        f"{log} has {n} distinct client IP addresses.",
    )


def _fix_script(r: random.Random) -> tuple[str, list[Step], str, str]:
    script, jobs = f"scripts/{r.choice(_STEMS)}.sh", r.randint(2, 60)
    return (
        f"Running {script} fails. Make it run and report how many jobs it processed.",
        [
            ("Run it to see the error.", f"./{script}", f"bash: ./{script}: Permission denied"),
            (
                "The executable bit is missing.",
                f"chmod +x {script} && ls -l {script}",
                f"-rwxr-xr-x 1 agent agent {r.randint(200, 3000)} Mar {r.randint(1, 28)} 10:{r.randint(10, 59)} {script}",
            ),
            ("Run it again.", f"./{script}", f"ok: {jobs} jobs processed"),
        ],
        str(jobs),
        f"{script} was missing its executable bit. After `chmod +x` it runs and processed {jobs} jobs.",
    )


def _csv_sum(r: random.Random) -> tuple[str, list[Step], str, str]:
    path, col = f"data/{r.choice(_STEMS)}.csv", r.choice(("amount", "duration", "bytes"))
    rows = [r.randint(1, 500) for _ in range(r.randint(4, 9))]
    code = f"import csv; print(sum(int(r['{col}']) for r in csv.DictReader(open('{path}'))))"
    return (
        f"What is the total of the {col} column in {path}?",
        [
            (
                "Check the header.",
                f"head -n 2 {path}",
                f"id,{col},owner\n1,{rows[0]},{r.choice(_STEMS)}",
            ),
            ("Sum the column with Python.", f'python3 -c "{code}"', str(sum(rows))),
        ],
        str(sum(rows)),
        f"The {col} column of {path} sums to {sum(rows)}.",
    )


_TASKS = {
    "count_errors": _count_errors,
    "largest_file": _largest,
    "unique_ips": _unique_ips,
    "fix_permissions": _fix_script,
    "csv_sum": _csv_sum,
}


def terminal(rng: random.Random, n: int) -> list[dict]:
    """Shell tasks solved in 1-3 commands; the checker compares the final answer."""
    plan = plan_defects(rng, n, TRAJECTORY_DEFECTS)
    records = []
    for i in range(n):
        defect = plan.get(i)
        topic = rng.choice(sorted(_TASKS))
        task, steps, answer, summary = _TASKS[topic](rng)
        messages: list[dict] = [
            {
                "role": "system",
                "content": "You are a terminal agent. Run commands with the tools; "
                "end with a one-line answer.",
            },
            {"role": "user", "content": task},
        ]
        for reasoning, command, output in steps:
            args: dict = {"command": command}
            if rng.random() < 0.3:
                args["timeout"] = rng.choice((30, 60, 120))
            call = tool_call(rng, "execute_command", args)
            messages += [
                assistant("", reasoning_fields(rng, reasoning), tool_calls=[call]),
                tool_result(call, output),
            ]
        if defect == "tests_failed":
            summary = f"I could not determine it reliably; my best guess is {rng.randint(0, 9)}."
        record = {"id": f"terminal-{i:05d}", "task": task, "messages": messages, "tools": TOOLS}
        record.update(finished=True, tests_passed=defect != "tests_failed")
        if defect == "unfinished":
            record["messages"] = messages[:-1] if len(messages) > 4 else messages[:3]
            record.update(finished=False, tests_passed=False)
        else:
            messages.append(assistant(summary, reasoning_fields(rng, f"The answer is {answer}.")))
        record.update(
            used_in=used_in(rng), meta={"topic": topic, "defect": defect, "answer": answer}
        )
        if defect == "malformed_tool_call":
            record["meta"]["defect_detail"] = break_tool_call(rng, record)
        records.append(record)
    return records
