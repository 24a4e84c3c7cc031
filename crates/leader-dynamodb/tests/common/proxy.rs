//! A proxy in front of the test server, for tests that change what it answers: the request
//! sent on, and its answer handed back with what the proxy changed.

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// `POST /` to `upstream` with `headers` and `body`, in HTTP/1.0 (an answer that ends with the
/// connection): the answer's status, headers and body, or `None` when it did not come.
pub async fn post(
    upstream: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Option<(u16, Vec<(String, String)>, Bytes)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(upstream).await.ok()?;
    let mut head = String::from("POST / HTTP/1.0\r\n");
    for (name, value) in headers {
        if !matches!(name.as_str(), "host" | "content-length" | "connection") {
            head += &format!("{name}: {}\r\n", value.to_str().ok()?);
        }
    }
    head += &format!(
        "host: {upstream}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.ok()?;
    stream.write_all(body).await.ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&answer[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_owned(), value.trim().to_owned()))
        .collect();
    Some((status, headers, Bytes::copy_from_slice(&answer[end + 4..])))
}

/// The answer `status`, `headers` and `bytes` as the proxy's response: the body may have
/// changed, so its length and checksum are the proxy's to give.
pub fn respond(status: u16, headers: &[(String, String)], bytes: Bytes) -> Response {
    let mut response =
        Response::builder().status(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY));
    for (name, value) in headers {
        if !matches!(
            name.to_ascii_lowercase().as_str(),
            "content-length" | "transfer-encoding" | "connection" | "x-amz-crc32"
        ) {
            response = response.header(name.as_str(), value.as_str());
        }
    }
    response
        .body(axum::body::Body::from(bytes))
        .unwrap_or_else(|_| StatusCode::BAD_GATEWAY.into_response())
}

/// The test server's `host:port`, where a proxy sends what it passes on.
pub fn upstream() -> String {
    super::endpoint()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// Serves `app` (the proxy) on a port of loopback, and builds a store on `table` through it,
/// with `configure` applied to its SDK configuration and `build` to its store builder: a store
/// that creates its table when it checks it.
pub async fn store_through(
    app: axum::Router,
    table: String,
    configure: impl FnOnce(aws_config::SdkConfig) -> aws_config::SdkConfig,
    build: impl FnOnce(leader_dynamodb::DynamoStoreBuilder) -> leader_dynamodb::DynamoStoreBuilder,
) -> leader_dynamodb::DynamoStore {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port for the proxy");
    let url = format!("http://{}", listener.local_addr().expect("its address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let config = super::sdk_config()
        .await
        .into_builder()
        .endpoint_url(url)
        .build();
    build(leader_dynamodb::DynamoStore::builder(table))
        .sdk_config(configure(config))
        .create_table(true)
        .build()
        .await
        .expect("a store through the proxy")
}
