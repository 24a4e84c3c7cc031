-- The least the election's user needs: read, insert and update rows of the lock table; no
-- DELETE, no CREATE, nothing on other tables. Replace `app`, the user and the host.
CREATE USER IF NOT EXISTS 'leader'@'%' IDENTIFIED BY 'change-me';
GRANT SELECT, INSERT, UPDATE ON `app`.`leader_election` TO 'leader'@'%';
