//! The statements' parameters, each with its type. Every statement goes out unnamed, with its
//! parameters' types ([`Client::query_typed`](tokio_postgres::Client::query_typed)): parsed,
//! bound and run in one round trip, leaving no prepared statement on the server's session. A
//! pooler in transaction mode (PgBouncer's `pool_mode = transaction`, what many managed services
//! offer) gives each transaction whichever server session is free, where a statement prepared
//! on another one is missing, or its name taken by another client.

use chrono::{DateTime, Utc};
use tokio_postgres::types::{ToSql, Type};

/// A parameter, and the type it is sent as.
pub(crate) type Typed<'a> = (&'a (dyn ToSql + Sync), Type);

/// A value the statements take, and its Postgres type.
pub(crate) trait Param: ToSql + Sync {
    /// The type the value is sent as.
    const TYPE: Type;
}

impl Param for String {
    const TYPE: Type = Type::TEXT;
}

impl Param for &str {
    const TYPE: Type = Type::TEXT;
}

impl Param for Option<String> {
    const TYPE: Type = Type::TEXT;
}

impl Param for i64 {
    const TYPE: Type = Type::INT8;
}

impl Param for DateTime<Utc> {
    const TYPE: Type = Type::TIMESTAMPTZ;
}

impl Param for Vec<String> {
    const TYPE: Type = Type::TEXT_ARRAY;
}

impl Param for &[String] {
    const TYPE: Type = Type::TEXT_ARRAY;
}

impl Param for Vec<Option<String>> {
    const TYPE: Type = Type::TEXT_ARRAY;
}

impl Param for Vec<i64> {
    const TYPE: Type = Type::INT8_ARRAY;
}

impl Param for Vec<DateTime<Utc>> {
    const TYPE: Type = Type::TIMESTAMPTZ_ARRAY;
}

/// `value` with its type.
pub(crate) fn typed<T: Param>(value: &T) -> Typed<'_> {
    (value, T::TYPE)
}
