//! A TCP proxy that can be frozen ([`Freezer`]): what a stopped relay
//! process or a black-holed route looks like to a client.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy in front of `upstream` that can be frozen: from then on it
/// forwards nothing in either direction and closes nothing, like a relay
/// process that was stopped (SIGSTOP) or a black-holed route.
pub struct Freezer {
    /// Where clients connect (the proxy).
    pub addr: SocketAddr,
    /// Send `true` to freeze the proxy.
    pub freeze: watch::Sender<bool>,
}

impl Freezer {
    /// A proxy to `upstream`, not frozen yet.
    pub async fn start(upstream: SocketAddr) -> Freezer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (freeze, frozen) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    return;
                };
                let up = TcpStream::connect(upstream).await.unwrap();
                let (dr, dw) = down.into_split();
                let (ur, uw) = up.into_split();
                tokio::spawn(pump(dr, uw, frozen.clone()));
                tokio::spawn(pump(ur, dw, frozen.clone()));
            }
        });
        Freezer { addr, freeze }
    }
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut frozen: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let is_frozen = *frozen.borrow_and_update();
        if is_frozen {
            std::future::pending::<()>().await;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = frozen.changed() => continue,
        };
        let is_frozen = *frozen.borrow();
        if is_frozen {
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
