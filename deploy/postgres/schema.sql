-- The lock table of leader-postgres, as PostgresStore::create_table creates it.
-- One row per election name; `version` is the compare-and-swap column, `leader_transitions` the
-- fencing term (it grows on every acquisition), `expires_at` the lease end on the server's clock,
-- and `extensions` what features built on the election keep (JSON, or NULL).
-- Run it as the table's owner; then grant the electing role its rights with grants.sql.

CREATE TABLE IF NOT EXISTS "public"."leader_election" (
    name               text        PRIMARY KEY,
    holder_identity    text        NOT NULL DEFAULT '',
    lease_duration_ms  bigint      NOT NULL,
    acquire_time       timestamptz NOT NULL,
    renew_time         timestamptz NOT NULL,
    leader_transitions bigint      NOT NULL DEFAULT 0,
    strategy           text,
    preferred_holder   text,
    version            bigint      NOT NULL,
    expires_at         timestamptz NOT NULL,
    extensions         text
);
