"""store/: the step-history store, a SQL projection of a run's event log (docs/store.md).

- schema:     the tables (SQLAlchemy 2 typed ORM); migrations/ holds their Alembic history
- db:         ``open_store(url)``: SQLite (WAL) or PostgreSQL, migrated to head on open
- projection: events → rows, applied in batches with the tracking row, idempotently
- queries:    run summaries, step history, tenant/env statistics, replay order, policy versions
- dump:       canonical dump and digest of a run's tables (rebuild proofs)
- synthetic:  a realistic synthetic run and a check of a projection against its truth
"""
