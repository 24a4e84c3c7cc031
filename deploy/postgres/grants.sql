-- Least privilege for the role your service elects with: SELECT, INSERT and UPDATE on the lock
-- table only (no DELETE, no DDL). Advisory locks and LISTEN/NOTIFY need no grant.
-- Replace leader_app with your role, then run as the table's owner:
--   psql -v role=leader_app -f deploy/postgres/grants.sql

\if :{?role}
\else
  \set role leader_app
\endif

GRANT USAGE ON SCHEMA public TO :"role";
GRANT SELECT, INSERT, UPDATE ON TABLE public.leader_election TO :"role";
