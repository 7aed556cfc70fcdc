"""store/: the step-history store, a SQL projection of a run's event log (docs/store.md).

- schema:     the tables (SQLAlchemy 2 typed ORM); migrations/ holds their Alembic history
- db:         SQLite (WAL) or PostgreSQL: ``open_store_for_writing(url)`` migrates to head (the
              recorder), ``open_store_read_only(url)`` checks the revision and changes nothing
- readmodel:  the read model of the log: the fact each event states (read by the projectors,
              the monitor and replay), the same facts from a store's rows, the evaluation summary
- specs:      which columns each event writes together, and how repeats merge (first/last)
- derived:    columns computed from others (staleness), stated once for Python and SQL
- projectors: one function per fact of the read model: the row parts it writes
- projection: the fold and the upserts, applied in batches with the tracking row, idempotently
- queries:    run summaries, step history, tenant/env statistics, replay order, policy versions
- dump:       canonical dump and digest of a run's tables (rebuild proofs)
- settings:   the ``[store]`` section of a run config
"""
