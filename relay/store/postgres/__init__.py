"""The PostgreSQL store: several relay-trio servers sharing one database (see store.py)."""

from relay.store.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
