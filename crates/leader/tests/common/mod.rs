//! What the HTTP layers' tests share: an HTTP client and an axum application served on
//! loopback.

use axum::Router;

/// A plain-HTTP client.
pub(crate) fn client() -> reqwest::Client {
    // reqwest is built without a TLS provider of its own; plain HTTP still builds one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// Serves `app` on a free loopback port in the background; its address (`http://IP:PORT`).
pub(crate) async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}
