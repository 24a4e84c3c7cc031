-- The lock table of leader-mysql, under its default name: what MysqlStore::create_table
-- creates. Run it as the table's owner when the election's user may not create tables
-- (grants.sql), or from a migration tool.
CREATE TABLE IF NOT EXISTS `leader_election` (
    name               VARBINARY(512) NOT NULL PRIMARY KEY,
    holder_identity    VARBINARY(512) NOT NULL DEFAULT '',
    lease_duration_ms  BIGINT         NOT NULL,
    acquire_time       DATETIME(6)    NOT NULL,
    renew_time         DATETIME(6)    NOT NULL,
    leader_transitions BIGINT         NOT NULL DEFAULT 0,
    strategy           VARBINARY(512) NULL,
    preferred_holder   VARBINARY(512) NULL,
    version            BIGINT         NOT NULL,
    expires_at         DATETIME(6)    NOT NULL,
    extensions         MEDIUMBLOB     NULL
) ENGINE=InnoDB;
