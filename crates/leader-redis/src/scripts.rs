//! The Lua scripts: each operation is one script run atomically on the server (one `EVALSHA`).
//!
//! An election is a hash `KEYS[1]` with the fields `version`, `holder`, `transitions` (the
//! fencing token), `record` (the record as JSON) and `preferred` (a pending handover's candidate,
//! or empty), which expires (`PEXPIRE`) one lease duration after the holder's last write; a
//! counter `KEYS[2]` without expiry that every acquisition increments, so fencing tokens keep
//! growing when the hash expires; and `KEYS[3]`, without expiry, the record's extensions as
//! last written (a JSON object; absent when there are none), which an acquisition of an expired
//! lease puts back into the record, so that what a holder recorded there outlives it.

use std::sync::LazyLock;

/// A script's source and its SHA1, for `EVALSHA` with a fallback to `EVAL`.
#[derive(Debug)]
pub(crate) struct LuaScript {
    pub(crate) source: String,
    pub(crate) sha: String,
}

/// Reads and checks the hash; shared by every script. The fence counter's type is checked by the
/// scripts that read for a decision (`get`, `try_acquire`) and by `create`, not by `update`:
/// a renewal never touches the counter, and an acquisition through `update` fails on a broken
/// counter anyway (`INCR` refuses it).
const COMMON: &str = r#"
local function fence_error(k)
  local kind = redis.call('TYPE', k)['ok']
  if kind == 'none' then return nil end
  if kind ~= 'string' then
    return 'LEADER_INVALID the fence counter ' .. k .. ' holds a ' .. kind .. ', not a counter'
  end
  local n = tonumber(redis.call('GET', k))
  if not n or n < 0 or n ~= math.floor(n) then
    return 'LEADER_INVALID the fence counter ' .. k .. ' is not a whole number'
  end
  return nil
end

local function current(key)
  -- pcall: a key of another type is this election's bad record, not an error that would end a
  -- script reading many elections.
  local v = redis.pcall('HMGET', key, 'version', 'holder', 'transitions', 'record', 'preferred')
  if v.err then
    return nil, 'LEADER_INVALID the key holds a value of another type, not a lock hash'
  end
  if not v[1] and not v[2] and not v[3] and not v[4] then
    if redis.call('EXISTS', key) == 1 then
      return nil, 'LEADER_INVALID the hash has none of the lock fields (version, holder, transitions, record)'
    end
    return false
  end
  local version, transitions = tonumber(v[1]), tonumber(v[3])
  if not version or not transitions or transitions < 0 or not v[2] or not v[4] then
    return nil, 'LEADER_INVALID missing or malformed lock fields'
  end
  local ok, record = pcall(cjson.decode, v[4])
  if not ok or type(record) ~= 'table' then
    return nil, 'LEADER_INVALID the record field is not a JSON object'
  end
  return {version = v[1], holder = v[2], transitions = transitions, record = v[4], preferred = v[5] or ''}
end

-- `current(key)` for a decision, once the fence counter `fence_key` is checked too.
local function checked_current(key, fence_key)
  local bad_fence = fence_error(fence_key)
  if bad_fence then return nil, bad_fence end
  return current(key)
end

-- A whole Lua number as Redis stores an integer: a number given to `redis.call` as it is may be
-- sent in scientific notation (`1e+17` on Redis 7.0, `1e+9` on 7.2.0 to 7.2.4), which `INCR`
-- then refuses for good. Exact below 2^53, the highest token the lock gives (`MAX_TOKEN`).
local function integer(n)
  return string.format('%.0f', n)
end

local function fence(key, at_least)
  local n = redis.call('INCR', key)
  if n < at_least then
    redis.call('SET', key, integer(at_least))
    n = at_least
  end
  return n
end

local function write(key, version, holder, transitions, record, lease_ms, preferred)
  redis.call('HSET', key, 'version', version, 'holder', holder, 'transitions', integer(transitions), 'record', record, 'preferred', preferred)
  if lease_ms then redis.call('PEXPIRE', key, lease_ms) end
  local extensions = cjson.decode(record).extensions
  if type(extensions) == 'table' and next(extensions) ~= nil then
    redis.call('SET', KEYS[3], cjson.encode(extensions))
  else
    redis.call('DEL', KEYS[3])
  end
end

-- The record JSON `record` with the extensions kept in KEYS[3] (after the hash expired), if any.
-- The record's other numbers are small: its fencing token is the hash's field, not the JSON's.
local function with_kept_extensions(record)
  local kept = redis.call('GET', KEYS[3])
  if not kept then return record end
  local ok, extensions = pcall(cjson.decode, kept)
  if not ok or type(extensions) ~= 'table' then return record end
  local wanted = cjson.decode(record)
  wanted.extensions = extensions
  return cjson.encode(wanted)
end

local function next_version(version)
  return integer(tonumber(version) + 1)
end
"#;

fn script(body: &str) -> LuaScript {
    bare(&format!("{COMMON}\n{body}"))
}

/// A script without the shared functions, for the renewal: the less a script runs, the less the
/// server spends on it.
fn bare(source: &str) -> LuaScript {
    let source = source.to_owned();
    // The driver's script type computes the SHA1 the server will use.
    let sha = redis::Script::new(&source).get_hash().to_owned();
    LuaScript { source, sha }
}

/// `get`: returns `false` (absent) or `{version, holder, transitions, record}`.
pub(crate) static GET: LazyLock<LuaScript> = LazyLock::new(|| {
    script(
        r#"
local cur, err = checked_current(KEYS[1], KEYS[2])
if err then return redis.error_reply(err) end
if not cur then return false end
return {cur.version, cur.holder, cur.transitions, cur.record}
"#,
    )
});

/// `create`: ARGV record JSON, holder, transitions, lease ms, first version, preferred holder.
/// The record carries the extensions an expired hash left, if any. Returns `{version,
/// transitions, record as written}`.
pub(crate) static CREATE: LazyLock<LuaScript> = LazyLock::new(|| {
    script(
        r#"
local bad_fence = fence_error(KEYS[2])
if bad_fence then return redis.error_reply(bad_fence) end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('LEADER_CONFLICT the lock exists')
end
local transitions = tonumber(ARGV[3])
if ARGV[2] ~= '' then transitions = fence(KEYS[2], transitions) end
local record = with_kept_extensions(ARGV[1])
write(KEYS[1], ARGV[5], ARGV[2], transitions, record, ARGV[4], ARGV[6])
return {ARGV[5], transitions, record}
"#,
    )
});

/// `update`: ARGV expected version, record JSON, holder, transitions, lease ms, channel,
/// preferred holder, `1` for a write on the holder's behalf (a handover request).
/// A write that makes `holder` the holder anew (or raises the transitions) is an acquisition and
/// takes the next fencing token. A write on the holder's behalf must leave the holder as it is,
/// and keeps its expiry. A release (empty holder) or a handover request publishes on the
/// channel. Returns `{version, transitions}`.
pub(crate) static UPDATE: LazyLock<LuaScript> = LazyLock::new(|| {
    script(
        r#"
local cur, err = current(KEYS[1])
if err then return redis.error_reply(err) end
if not cur or cur.version ~= ARGV[1] then
  return redis.error_reply('LEADER_CONFLICT the lock record changed')
end
local on_behalf = ARGV[8] == '1'
if on_behalf and ARGV[3] ~= cur.holder then
  return redis.error_reply('LEADER_CONFLICT the holder changed')
end
local transitions = tonumber(ARGV[4])
if ARGV[3] ~= '' and (ARGV[3] ~= cur.holder or transitions > cur.transitions) then
  transitions = fence(KEYS[2], transitions)
end
local version = next_version(cur.version)
local lease_ms = ARGV[5]
if on_behalf then lease_ms = nil end
write(KEYS[1], version, ARGV[3], transitions, ARGV[2], lease_ms, ARGV[7])
if ARGV[3] == '' or ARGV[7] ~= '' then redis.call('PUBLISH', ARGV[6], 'changed') end
return {version, transitions}
"#,
    )
});

/// `renew`: ARGV expected version, lease ms. The holder's renewal: extends the hash's expiry if
/// it still holds the version the holder wrote last, and changes nothing else (a hand-written
/// lock's extend does the same, with one more comparison than a read). Returns 1.
pub(crate) static RENEW: LazyLock<LuaScript> = LazyLock::new(|| {
    bare(
        r#"
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then
  return redis.error_reply('LEADER_CONFLICT the lock record changed')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"#,
    )
});

/// `time_left`: the holder's milliseconds left (`PTTL`), or a negative number when nobody holds
/// the lease or the hash does not expire.
pub(crate) static TIME_LEFT: LazyLock<LuaScript> = LazyLock::new(|| {
    bare(
        r#"
local holder = redis.call('HGET', KEYS[1], 'holder')
if not holder or holder == '' then return -2 end
return redis.call('PTTL', KEYS[1])
"#,
    )
});

/// `try_acquire`: ARGV record JSON, holder, lease ms, first version, lowest fencing token
/// wanted. Takes the lease when the hash is gone (expired on the server's clock) or free,
/// unless a pending handover names another candidate; a lease held by `holder` is held too
/// (another process may run with that identity).
/// Returns `{1 acquired | 0 held, version, transitions, holder, record, ms left on a held
/// lease (PTTL, the server's clock)}`.
pub(crate) static TRY_ACQUIRE: LazyLock<LuaScript> = LazyLock::new(|| {
    script(
        r#"
local cur, err = checked_current(KEYS[1], KEYS[2])
if err then return redis.error_reply(err) end
local version, transitions
local record = ARGV[1]
if not cur then
  version = ARGV[4]
  transitions = fence(KEYS[2], math.max(1, tonumber(ARGV[5])))
  record = with_kept_extensions(record)
elseif cur.holder == '' and (cur.preferred == '' or cur.preferred == ARGV[2]) then
  version = next_version(cur.version)
  transitions = fence(KEYS[2], math.max(cur.transitions + 1, tonumber(ARGV[5])))
  -- The stored extensions, not the candidate's (only a holder writes them). The record's
  -- other numbers are small: its fencing token is the hash's field, not the JSON's.
  local stored = cjson.decode(cur.record).extensions
  if stored then
    local wanted = cjson.decode(record)
    wanted.extensions = stored
    record = cjson.encode(wanted)
  end
else
  local left = -1
  if cur.holder ~= '' then left = redis.call('PTTL', KEYS[1]) end
  return {0, cur.version, cur.transitions, cur.holder, cur.record, left}
end
write(KEYS[1], version, ARGV[2], transitions, record, ARGV[3], '')
return {1, version, transitions, ARGV[2], record, -1}
"#,
    )
});

/// A shard set's round: `renew` of many elections, then a read of many. ARGV[1] is the number
/// `n` of renewals. KEYS[1..n] are the renewed hashes, with ARGV the expected version and lease
/// ms of each, in pairs: each hash still holding its version has its expiry extended, as
/// `renew` does. The read's keys follow, three per election (its hash, fence and extensions),
/// with an ARGV each after the pairs: what the reader holds of the election, `-` for absent, a
/// version, or empty for nothing. Returns `{renewed, entries}`: 1 (renewed) or 0 (the record
/// changed) per renewal; per election read `{0}` (none), `{1, version, holder, transitions,
/// record}`, `{2, error}` (not a lock's hash), or `{3}` (still as the reader holds it).
pub(crate) static RENEW_AND_READ: LazyLock<LuaScript> = LazyLock::new(|| {
    script(
        r#"
-- The entry of an election whose keys start at KEYS[i], read in full.
local function read_entry(i)
  local cur, err = checked_current(KEYS[i], KEYS[i + 1])
  if err then return {2, err} end
  if not cur then return {0} end
  return {1, cur.version, cur.holder, cur.transitions, cur.record}
end

local n = tonumber(ARGV[1])
local renewed = {}
for i = 1, n do
  if redis.pcall('HGET', KEYS[i], 'version') == ARGV[2 * i] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i + 1])
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end

local entries = {}
for i = n + 1, #KEYS, 3 do
  local known = ARGV[2 * n + 1 + (i - n + 2) / 3]
  local entry
  if known == '-' then
    if redis.call('EXISTS', KEYS[i]) == 0 then entry = {3} end
  elseif known ~= '' and redis.pcall('HGET', KEYS[i], 'version') == known then
    entry = {3}
  end
  entries[#entries + 1] = entry or read_entry(i)
end
return {renewed, entries}
"#,
    )
});
