//! The check every backend's redaction test makes: nothing a backend makes of a URL holding a
//! password (the parsed lock URL, its store builder, the store or the error) shows it.

use crate::secrets::{assert_built_hidden, assert_hidden, assert_parsed_hidden};

/// How a backend's store takes a URL of its own: the builder it starts from one, and the
/// store's redacted URL.
#[derive(Debug)]
pub struct StoreUrl<B, S> {
    /// The store builder of a URL.
    pub builder: fn(&str) -> B,
    /// The store's URL, as it shows it.
    pub redacted: fn(&S) -> &str,
}

/// Panics when what a backend makes of any of `urls` shows a part of its password: the parse
/// error, or the parsed URL (`parse`) by its description and `Debug`, then the store builder it
/// gives (`store_of`) and what `build` makes of that builder; and, for a store that takes a URL
/// of its own (`store_url`), that builder, what `build` makes of it and the store's redacted URL.
pub async fn assert_urls_hidden<P, PE, B, S, BE>(
    urls: impl IntoIterator<Item = String>,
    parse: impl Fn(&str) -> Result<P, PE>,
    store_of: impl Fn(&P) -> B,
    build: impl AsyncFn(B) -> Result<S, BE>,
    store_url: Option<StoreUrl<B, S>>,
) where
    P: leader_core::LockTarget + std::fmt::Debug,
    PE: std::fmt::Display + std::fmt::Debug,
    B: std::fmt::Debug,
    S: std::fmt::Debug,
    BE: std::fmt::Display + std::fmt::Debug,
{
    for url in urls {
        if let Some(parsed) = assert_parsed_hidden(&url, parse(&url)) {
            assert_built_hidden(&url, store_of(&parsed), &build).await;
        }
        if let Some(own) = &store_url
            && let Some(store) = assert_built_hidden(&url, (own.builder)(&url), &build).await
        {
            assert_hidden(&url, (own.redacted)(&store));
        }
    }
}
