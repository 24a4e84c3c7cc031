-- For a lock table made by an earlier version of leader-postgres: the `extensions` column, where
-- features built on the election (scheduled jobs, shards) keep their data. Run it as the table's
-- owner; PostgresStore::create_table runs it too. leader_postgres::MIGRATION holds the same.

ALTER TABLE "public"."leader_election" ADD COLUMN IF NOT EXISTS extensions text;
