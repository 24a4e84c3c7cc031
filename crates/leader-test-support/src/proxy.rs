//! A TCP proxy on loopback between a client and its server, through which a test cuts the
//! network (as a partition, or a stopped process whose socket buffers hold what is sent), slows
//! it down, takes the server away, or strands the connections open at a moment.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the proxy does with the bytes it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forwards at once.
    Open,
    /// Holds every chunk until this long after it arrived (a latency spike).
    Delay(Duration),
    /// Forwards nothing, in either direction, on old and new connections alike; the bytes wait
    /// and flow again, late, when the mode changes (a partition that heals before TCP gives up).
    Cut,
    /// Closes every connection, and every new one at once: a server (or the proxy) that is down.
    Down,
}

/// A running proxy; stops listening when dropped (open connections are aborted too).
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    mode: watch::Sender<Mode>,
    /// How many times the connections open then were stranded ([`Proxy::strand`]).
    strandings: watch::Sender<u64>,
    /// The local port of each connection the proxy opened to the server.
    upstream_ports: Arc<Mutex<Vec<u16>>>,
    /// Where new connections go ([`Proxy::move_to`]).
    upstream: watch::Sender<SocketAddr>,
    /// How many connections clients opened to the proxy.
    accepted: Arc<AtomicU64>,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    ///
    /// # Errors
    /// The port cannot be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        Self::start_on(0, upstream).await
    }

    /// Listens on loopback port `port` (0: an ephemeral one) and forwards every connection to
    /// `upstream`.
    ///
    /// # Errors
    /// The port cannot be bound.
    pub async fn start_on(port: u16, upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(("127.0.0.1", port)).await?;
        let port = listener.local_addr()?.port();
        let (mode, _) = watch::channel(Mode::Open);
        let (strandings, _) = watch::channel(0);
        let modes = mode.clone();
        let stranded = strandings.clone();
        let upstream_ports = Arc::new(Mutex::new(Vec::new()));
        let ports = Arc::clone(&upstream_ports);
        let (upstream, _) = watch::channel(upstream);
        let upstreams = upstream.clone();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&accepted);
        let accept = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::Relaxed);
                let modes = modes.subscribe();
                let strand = Strand {
                    born: *stranded.borrow(),
                    strandings: stranded.subscribe(),
                };
                if *modes.borrow() == Mode::Down {
                    drop(client);
                    continue;
                }
                let ports = Arc::clone(&ports);
                let upstream = *upstreams.borrow();
                connections.spawn(async move {
                    // A refused upstream (the server is down) closes the client's connection,
                    // as the server's own refusal would.
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        if let Ok(local) = server.local_addr() {
                            ports
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .push(local.port());
                        }
                        let _ = client.set_nodelay(true);
                        let _ = server.set_nodelay(true);
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::join!(
                            pump(client_read, server_write, modes.clone(), strand.clone()),
                            pump(server_read, client_write, modes, strand),
                        );
                    }
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Self {
            port,
            mode,
            strandings,
            upstream_ports,
            upstream,
            accepted,
            accept,
        })
    }

    /// Sends new connections to `upstream` from now on, and leaves those open with the server
    /// they reached: a name or address that a failover moved to another server.
    pub fn move_to(&self, upstream: SocketAddr) {
        self.upstream.send_replace(upstream);
    }

    /// The loopback port candidates connect to.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The local port of each connection the proxy opened to the server, in order: what the
    /// server's own lists of its clients show of them.
    #[must_use]
    pub fn upstream_ports(&self) -> Vec<u16> {
        self.upstream_ports
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many connections clients opened to the proxy so far, whether carried or closed at
    /// once ([`Mode::Down`]).
    #[must_use]
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// Changes what the proxy does, for every connection at once.
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Forwards nothing more, ever, on the connections open now, and closes none of them: a
    /// firewall or NAT that dropped their state, with no reset. New connections are carried
    /// as the mode says.
    pub fn strand(&self) {
        self.strandings.send_modify(|count| *count += 1);
    }
}

/// Whether a connection was stranded: it was opened before the last [`Proxy::strand`].
#[derive(Clone)]
struct Strand {
    /// The strandings before the connection was opened.
    born: u64,
    strandings: watch::Receiver<u64>,
}

impl Strand {
    fn is_stranded(&self) -> bool {
        *self.strandings.borrow() > self.born
    }

    /// What is sent on a stranded connection vanishes: it ends only with the proxy, or when
    /// the proxy goes down.
    async fn vanish(&self, mode: &mut watch::Receiver<Mode>) {
        let _ = mode.wait_for(|m| *m == Mode::Down).await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Carries one direction: a reader stamps each chunk with its arrival, a writer hands it on when
/// the mode allows.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
    strand: Strand,
) {
    let (chunks, mut pending) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buffer = vec![0_u8; 16 * 1024];
        loop {
            match from.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if chunks.send((Instant::now(), buffer[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        loop {
            let next = tokio::select! {
                next = pending.recv() => next,
                _ = mode.wait_for(|m| *m == Mode::Down) => return,
            };
            let Some((arrived, chunk)) = next else { break };
            if strand.is_stranded() {
                return strand.vanish(&mut mode).await;
            }
            loop {
                let current = *mode.borrow_and_update();
                match current {
                    Mode::Open => break,
                    Mode::Delay(by) if Instant::now() >= arrived + by => break,
                    Mode::Delay(by) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(arrived + by) => break,
                            changed = mode.changed() => if changed.is_err() { return; },
                        }
                    }
                    Mode::Cut => {
                        if mode.changed().await.is_err() {
                            return;
                        }
                    }
                    Mode::Down => return,
                }
            }
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        // The other side closed: that too waits out a cut (a FIN sent during a partition
        // arrives once it heals; a stopped process reads it once it runs again), and never
        // reaches a stranded connection.
        if strand.is_stranded() {
            return strand.vanish(&mut mode).await;
        }
        if mode.wait_for(|m| *m != Mode::Cut).await.is_err() {
            return;
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
