"""store/: the step-history store, a SQL projection of a run's event log (docs/store.md).

- schema:     the tables (SQLAlchemy 2 typed ORM); migrations/ holds their Alembic history
- db:         ``open_store(url)``: SQLite (WAL) or PostgreSQL, migrated to head on open
- specs:      which columns each event writes together, and how repeats merge (first/last)
- derived:    columns computed from others (staleness), stated once for Python and SQL
- projectors: one function per event type: the row parts it writes
- projection: the fold and the upserts, applied in batches with the tracking row, idempotently
- queries:    run summaries, step history, tenant/env statistics, replay order, policy versions
- dump:       canonical dump and digest of a run's tables (rebuild proofs)
- settings:   the ``[store]`` section of a run config
"""
