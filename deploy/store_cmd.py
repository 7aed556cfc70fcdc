"""`jetrl runs | history [--tenant T | --tenants] | evals | export | rebuild`: the store, from the CLI.

Every command takes ``--db URL``; without it the run directory's SQLite file
(``<runs-dir>/<RUN>/store.db``) is used. ``runs``, ``history``, ``evals`` and ``export`` open
the store read-only and change nothing: a database that is not a jetrl store at this jetrl's
schema revision is an error naming it (exit 1). Only ``rebuild`` writes, and migrates. Heavy
imports (SQLAlchemy, NATS, pyarrow) happen inside the commands so that registering them costs
the rest of the CLI nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jetrl.store.export import EXPORT_FORMATS, export_run

if TYPE_CHECKING:
    from rich.table import Table

    from jetrl.store.db import Store
    from jetrl.store.queries import EvaluationSummary, StepRow, TenantSummary


# ----------------------------------------------------------------------------- helpers


def _default_db(runs_dir: str, run: str) -> Path:
    return Path(runs_dir) / run / "store.db"


def _store_url(args: argparse.Namespace, run: str) -> str:
    from jetrl.store.db import sqlite_url

    if args.db:
        return str(args.db)
    path = _default_db(args.runs_dir, run)
    if not path.exists():
        raise SystemExit(f"no store for run {run!r} at {path} (pass --db URL or --runs-dir)")
    return sqlite_url(path)


def _open_read_only(args: argparse.Namespace, run: str) -> Store:
    """The run's store, read-only; anything but a jetrl store at the head revision ends the
    command with the message (which names the database), not a traceback."""
    from jetrl.store.db import StoreError, open_store_read_only

    try:
        return open_store_read_only(_store_url(args, run))
    except StoreError as exc:
        raise SystemExit(f"jetrl {getattr(args, 'command', None) or 'store'}: {exc}") from None


def _open_for_writing(args: argparse.Namespace, run: str) -> Store:
    """The run's store for ``rebuild``: created if need be and migrated to the head revision."""
    from jetrl.store.db import open_store_for_writing

    return open_store_for_writing(_store_url(args, run))


def _ts(t: float | None) -> str:
    return "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _num(v: float | None, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _console() -> Any:
    from rich.console import Console

    # Piped output gets rich's 80 columns by default, which squeezes the wide tables unreadable.
    return Console() if sys.stdout.isatty() else Console(width=200)


# ----------------------------------------------------------------------------- runs


def cmd_runs(args: argparse.Namespace) -> int:
    """A table of runs: from ``--db``, or from every ``<runs-dir>/*/store.db`` (one that is not
    a readable jetrl store is reported and skipped, and the exit code is 1)."""
    from rich.table import Table

    from jetrl.store import queries
    from jetrl.store.db import StoreError, open_store_read_only, sqlite_url

    summaries = []
    unreadable = 0
    if args.db:
        try:
            store = open_store_read_only(args.db)
        except StoreError as exc:
            raise SystemExit(f"jetrl runs: {exc}") from None
        with store:
            summaries = queries.list_runs(store)
    else:
        for path in sorted(Path(args.runs_dir).glob("*/store.db")):
            try:
                store = open_store_read_only(sqlite_url(path))
            except StoreError as exc:
                print(f"jetrl runs: skipped {path}: {exc}", file=sys.stderr)
                unreadable += 1
                continue
            with store:
                summaries.extend(queries.list_runs(store))
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in summaries], indent=1, default=str))
        return 1 if unreadable else 0
    table = Table(title="jetrl runs")
    for col in (
        "run",
        "status",
        "started",
        "finished",
        "steps",
        "version",
        "rollouts",
        "trained",
        "withheld",
    ):
        table.add_column(col, justify="left" if col in ("run", "status", "started", "finished") else "right")
    table.add_column("reward", justify="right")
    table.add_column("dead letters", justify="right")
    for s in summaries:
        table.add_row(
            s.run_id,
            s.status,
            _ts(s.started_at),
            _ts(s.finished_at),
            str(s.steps),
            "" if s.latest_version is None else str(s.latest_version),
            str(s.rollouts),
            str(s.trained),
            str(s.withheld),
            _num(s.reward_mean),
            str(s.dead_letters),
        )
    _console().print(table)
    if not summaries:
        print(f"no runs found (looked in {args.db or args.runs_dir})", file=sys.stderr)
    return 1 if unreadable else 0


# ----------------------------------------------------------------------------- history


def cmd_history(args: argparse.Namespace) -> int:
    """The step table of a run (``--json`` for machines); ``--tenant T``: that tenant's summary
    and the steps it contributed to; ``--tenants``: every tenant's summary."""
    from rich.table import Table

    from jetrl.store import queries

    if args.tenant is not None or args.tenants:
        return _tenant_history(args)
    with _open_read_only(args, args.run) as store:
        summary = queries.run_summary(store, args.run)
        rows = queries.step_history(
            store, args.run, from_step=args.from_step, to_step=args.to_step, limit=args.limit
        )
        evals = queries.evaluation_summary(store, args.run)
    if summary is None:
        print(f"run {args.run!r} is not in the store", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
        return 0
    metric_names = sorted({k for r in rows for k in r.metrics})[:6]
    table = Table(
        title=f"run {args.run} — {summary.status}, {summary.steps} steps, {summary.rollouts} rollouts"
    )
    for col in (
        "step",
        "version",
        "time",
        "duration s",
        "tokens",
        "rollouts",
        "withheld",
        "reward",
        "staleness",
    ):
        table.add_column(col, justify="left" if col == "time" else "right")
    for m in metric_names:
        table.add_column(m, justify="right")
    for r in rows:
        table.add_row(
            str(r.step),
            str(r.policy_version),
            _ts(r.completed_at),
            _num(r.duration_s, 2),
            str(r.tokens),
            str(r.num_rollouts),
            str(r.withheld),
            _num(r.reward_mean),
            _num(r.staleness_mean, 2),
            *(
                _num(r.metrics.get(m)) if isinstance(r.metrics.get(m), float | int) else ""
                for m in metric_names
            ),
        )
    _console().print(table)
    if evals:
        _console().print(_evaluation_summary_table(evals))
    return 0


# ----------------------------------------------------------------------------- tenants


def _pair(a: float | None, b: float | None, digits: int = 3) -> str:
    return "" if a is None and b is None else f"{_num(a, digits)} / {_num(b, digits)}"


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def _tenant_history(args: argparse.Namespace) -> int:
    from jetrl.store import queries

    with _open_read_only(args, args.run) as store:
        if queries.run_summary(store, args.run) is None:
            print(f"run {args.run!r} is not in the store", file=sys.stderr)
            return 1
        if args.tenants:
            summaries = queries.tenant_summaries(store, args.run)
            if args.json:
                print(json.dumps([dataclasses.asdict(s) for s in summaries], indent=1))
            else:
                _console().print(_tenants_table(args.run, summaries))
            return 0
        summary = queries.tenant_summary(store, args.run, args.tenant)
        rows = queries.step_history(
            store,
            args.run,
            from_step=args.from_step,
            to_step=args.to_step,
            limit=args.limit,
            tenant=args.tenant,
        )
    if summary is None:
        print(f"run {args.run!r} has no events of tenant {args.tenant!r}", file=sys.stderr)
        return 1
    if args.json:
        out = {"summary": dataclasses.asdict(summary), "steps": [dataclasses.asdict(r) for r in rows]}
        print(json.dumps(out, indent=1))
        return 0
    console = _console()
    console.print(_tenant_summary_table(args.run, summary))
    console.print(_tenant_steps_table(summary.tenant, rows))
    return 0


def _tenant_summary_table(run: str, s: TenantSummary) -> Table:
    from rich.table import Table

    table = Table(
        title=f"run {run} — tenant {s.tenant}: {s.tasks} tasks, {s.rollouts} rollouts, "
        f"{s.rejections} rejections"
    )
    table.add_column("figure")
    table.add_column("value")
    later = f" ({s.tasks_first_turn} first turns, {s.tasks_later_turns} later turns)"
    for name, value in (
        ("tasks", f"{s.tasks}{later}"),
        ("tasks by env", _counts(s.tasks_by_env)),
        ("generations", f"{s.generations} ({s.completion_tokens} completion tokens)"),
        ("rollouts scored", str(s.rollouts)),
        ("trained", str(s.trained)),
        ("withheld", f"{s.withheld} {('(' + _counts(s.withheld_by_reason) + ')') if s.withheld else ''}"),
        ("pending", str(s.pending)),
        ("reward mean", _num(s.reward_mean)),
        ("reward by env", ", ".join(f"{e} {_num(r)}" for e, r in s.reward_by_env.items())),
        ("staleness mean", _num(s.staleness_mean, 2)),
        (
            "rejections",
            f"{s.rejections} {('(' + _counts(s.rejections_by_reason) + ')') if s.rejections else ''}",
        ),
        ("queued s p50 / p95", _pair(s.queued_s_p50, s.queued_s_p95)),
        ("task to scored s p50 / p95", _pair(s.task_to_scored_s_p50, s.task_to_scored_s_p95)),
    ):
        table.add_row(name, value.strip())
    return table


def _tenant_steps_table(tenant: str, rows: list[StepRow]) -> Table:
    from rich.table import Table

    table = Table(title=f"steps that trained on or withheld {tenant}'s rollouts")
    for col in (
        "step",
        "version",
        "time",
        "rollouts",
        f"{tenant} rollouts",
        f"{tenant} withheld",
        f"{tenant} reward",
        f"{tenant} staleness",
    ):
        table.add_column(col, justify="left" if col == "time" else "right")
    for r in rows:
        table.add_row(
            str(r.step),
            str(r.policy_version),
            _ts(r.completed_at),
            str(r.num_rollouts),
            str(r.tenant_rollouts or 0),
            str(r.withheld),
            _num(r.reward_mean),
            _num(r.staleness_mean, 2),
        )
    return table


def _tenants_table(run: str, summaries: list[TenantSummary]) -> Table:
    from rich.table import Table

    table = Table(title=f"run {run} — tenants")
    for col in (
        "tenant",
        "tasks",
        "later turns",
        "generations",
        "rollouts",
        "trained",
        "withheld",
        "reward",
        "rejections",
        "queued p50/p95 s",
        "to scored p50/p95 s",
    ):
        table.add_column(col, justify="left" if col in ("tenant", "rejections") else "right")
    for s in summaries:
        table.add_row(
            s.tenant,
            str(s.tasks),
            str(s.tasks_later_turns),
            str(s.generations),
            str(s.rollouts),
            str(s.trained),
            str(s.withheld),
            _num(s.reward_mean),
            f"{s.rejections} {('(' + _counts(s.rejections_by_reason) + ')') if s.rejections else ''}".strip(),
            _pair(s.queued_s_p50, s.queued_s_p95, 2),
            _pair(s.task_to_scored_s_p50, s.task_to_scored_s_p95, 2),
        )
    return table


# ----------------------------------------------------------------------------- evals


def _evaluation_summary_table(summaries: list[EvaluationSummary]) -> Table:
    """Latest and best pass@1 / pass@k per tenant and env."""
    from rich.table import Table

    table = Table(title="held-out evaluations: latest and best")
    for col in (
        "tenant",
        "env",
        "evals",
        "k",
        "latest version",
        "pass@1",
        "pass@k",
        "best pass@1",
        "best pass@k",
    ):
        table.add_column(col, justify="left" if col in ("tenant", "env") else "right")
    for s in summaries:
        table.add_row(
            s.tenant,
            s.env,
            str(s.evaluations),
            str(s.samples),
            str(s.latest_version),
            _num(s.latest_pass_at_1),
            _num(s.latest_pass_at_k),
            f"{_num(s.best_pass_at_1)} (v{s.best_pass_at_1_version})",
            f"{_num(s.best_pass_at_k)} (v{s.best_pass_at_k_version})",
        )
    return table


def cmd_evals(args: argparse.Namespace) -> int:
    """A run's held-out evaluations, one row per evaluated version, then the latest and best
    per env (``--json``: the rows and the summary)."""
    from rich.table import Table

    from jetrl.store import queries

    with _open_read_only(args, args.run) as store:
        rows = queries.evaluations(store, args.run, env=args.env)
        summaries = queries.summarize_evaluations(rows)
    if args.json:
        print(
            json.dumps(
                {
                    "evaluations": [dataclasses.asdict(r) for r in rows],
                    "summary": [dataclasses.asdict(s) for s in summaries],
                },
                indent=1,
            )
        )
        return 0
    if not rows:
        print(f"run {args.run!r} has no evaluations in the store", file=sys.stderr)
        return 0
    table = Table(title=f"run {args.run} — held-out evaluations")
    for col in (
        "tenant",
        "env",
        "version",
        "generated by",
        "tasks",
        "k",
        "pass@1",
        "pass@k",
        "reward",
        "time",
    ):
        table.add_column(col, justify="left" if col in ("tenant", "env", "time") else "right")
    for r in rows:
        table.add_row(
            r.tenant,
            r.env,
            str(r.policy_version),
            f"{r.version_min}..{r.version_max}",
            str(r.n_tasks),
            str(r.samples),
            _num(r.pass_at_1),
            _num(r.pass_at_k),
            _num(r.reward_mean),
            _ts(r.reported_at),
        )
    console = _console()
    console.print(table)
    console.print(_evaluation_summary_table(summaries))
    return 0


# ----------------------------------------------------------------------------- export


def cmd_export(args: argparse.Namespace) -> int:
    """Export a run's tables as JSON lines, CSV or Parquet, one file per table."""
    from jetrl.store import schema as sc

    all_tables = [t.name for t in sc.PROJECTION_TABLES]
    tables = all_tables if args.table in (None, "all") else [args.table]
    out = Path(args.out) if args.out else Path(args.runs_dir) / args.run / "export"
    with _open_read_only(args, args.run) as store:
        counts = export_run(store, args.run, out, args.format, tables)
    for name, n in counts.items():
        print(f"{out / f'{name}.{args.format}'}: {n} rows")
    return 0


# ----------------------------------------------------------------------------- rebuild


async def rebuild_run(
    store: Store,
    nats_url: str,
    run: str,
    *,
    consumer: str = "recorder",
    batch: int = 1000,
    to_head: bool = False,
) -> tuple[bool, dict[str, Any], dict[str, Any], dict[str, list[str]]]:
    """Drop the run's projection, rebuild it from the log up to the sequence it had recorded,
    and compare canonical dumps of every table. Returns (equal, old digests, new digests, diff).
    Stop the run's live recorder first: the rebuild rewrites its tracking row."""
    from jetrl.bus.client import Bus
    from jetrl.consumers.recorder import Recorder
    from jetrl.store import dump, queries

    with store.read() as conn:
        before = dump.dump_run(conn, run)
        recorded = queries.recorded_seq(conn, run, consumer)
    if recorded == 0:
        raise SystemExit(f"run {run!r} has nothing recorded by consumer {consumer!r}: nothing to rebuild")
    with store.write() as conn:
        dump.delete_run(conn, run)
    bus = await Bus.connect(nats_url.split(","), name=f"rebuild-{run}")
    rec = Recorder(bus, store, run, durable=consumer, batch=batch)
    try:
        await rec.replay(until_seq=recorded)
        with store.read() as conn:
            after = dump.dump_run(conn, run)
        if to_head:
            await rec.replay()
    finally:
        rec.close()
        await bus.close()
    old, new = dump.digest(before), dump.digest(after)
    return before == after, old, new, dump.diff(before, after)


def cmd_rebuild(args: argparse.Namespace) -> int:
    """Drop and rebuild a run's projection from its log; prove it equals the old one."""
    from rich.table import Table

    with _open_for_writing(args, args.run) as store:
        equal, old, new, diff = asyncio.run(
            rebuild_run(
                store, args.nats_url, args.run, consumer=args.consumer, batch=args.batch, to_head=args.to_head
            )
        )
    table = Table(title=f"rebuild of run {args.run}: {'identical' if equal else 'DIFFERENT'}")
    for col in ("table", "rows before", "rows after", "sha256 before", "sha256 after", "equal"):
        table.add_column(col)
    for name in old:
        o, n = old[name], new[name]
        table.add_row(name, str(o.rows), str(n.rows), o.sha256[:16], n.sha256[:16], "yes" if o == n else "NO")
    _console().print(table)
    for name, lines in diff.items():
        print(f"{name}:", *lines, sep="\n  ", file=sys.stderr)
    return 0 if equal else 1


# ----------------------------------------------------------------------------- registration


def _db_args(p: argparse.ArgumentParser, *, writes: bool = False) -> None:
    opened = (
        "opened for writing, created or migrated to this jetrl's schema if need be"
        if writes
        else "opened read-only: nothing is created or migrated"
    )
    p.add_argument(
        "--db", default=None, help=f"store URL (default: sqlite file <runs-dir>/<RUN>/store.db); {opened}"
    )
    p.add_argument("--runs-dir", default="runs", help="directory of run directories (default %(default)s)")


def add_store_commands(subparsers: Any) -> None:
    """Register runs, history, evals, export and rebuild on the `jetrl` CLI's subparsers."""
    p = subparsers.add_parser("runs", help="table of the runs in the store (read-only)")
    _db_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_runs)

    p = subparsers.add_parser("history", help="step history of a run (read-only)")
    p.add_argument("run")
    _db_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--from-step", type=int, default=None)
    p.add_argument("--to-step", type=int, default=None)
    p.add_argument("--limit", type=int, default=None)
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--tenant", default=None, help="one tenant's summary and the steps that trained on its rollouts"
    )
    who.add_argument("--tenants", action="store_true", help="every tenant's summary, one row each")
    p.set_defaults(func=cmd_history)

    p = subparsers.add_parser(
        "evals", help="held-out evaluations of a run (pass@1, pass@k per version; read-only)"
    )
    p.add_argument("run")
    _db_args(p)
    p.add_argument("--env", default=None, help="only this environment")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=cmd_evals)

    p = subparsers.add_parser(
        "export", help="export a run's tables (jsonl, csv, parquet; reads the store read-only)"
    )
    p.add_argument("run")
    _db_args(p)
    p.add_argument("--format", choices=EXPORT_FORMATS, default="jsonl")
    p.add_argument("--table", default="all", help="one table, or all (default)")
    p.add_argument("--out", default=None, help="output directory (default <runs-dir>/<RUN>/export)")
    p.set_defaults(func=cmd_export)

    p = subparsers.add_parser(
        "rebuild",
        help="drop and rebuild a run's store from its log, and prove it equal (migrates an older store)",
    )
    p.add_argument("run")
    _db_args(p, writes=True)
    p.add_argument("--nats-url", required=True, help="NATS server holding the run's log")
    p.add_argument(
        "--consumer", default="recorder", help="projection consumer to rebuild (default %(default)s)"
    )
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument(
        "--to-head", action="store_true", help="after the proof, go on recording up to the log head"
    )
    p.set_defaults(func=cmd_rebuild)


# The name deploy/cli.py looks for in its command modules.
add_command = add_store_commands
