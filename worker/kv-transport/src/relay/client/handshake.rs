//! The client's side of the relay handshake ([`crate::frame`]): read the
//! relay's HELLO, answer AUTH with a fresh nonce and the client's MAC, and
//! check the relay's proof of the shared secret before any request; and
//! [`authenticate`], the same on a raw connection.

use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use super::lost;
use super::reply::{read_reply, reply_error};
use crate::KvError;
use crate::frame::{
    self, AUTH_BODY_LEN, ErrCode, HEADER_LEN, HELLO_AUTH, Header, MAC_LEN, NONCE_LEN, Op, Secret,
    TRANSPORT as NAME, read_body,
};

/// The client's side of the handshake ([`crate::frame`]): reads HELLO,
/// answers AUTH, checks the relay's proof of the secret.
pub(super) async fn handshake<R, W>(
    rd: &mut R,
    wr: &mut W,
    peer: &str,
    secret: Option<&Secret>,
) -> Result<(), KvError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let protocol = |detail: String| KvError::Protocol {
        transport: NAME,
        peer: peer.to_string(),
        detail,
    };
    let unauthorized = |detail: &str| KvError::Unauthorized {
        transport: NAME,
        peer: peer.to_string(),
        detail: detail.to_string(),
    };
    let mut hb = [0u8; HEADER_LEN];
    rd.read_exact(&mut hb)
        .await
        .map_err(|e| lost(peer, "no handshake from the relay", e))?;
    let hello = Header::decode(&hb).map_err(|e| protocol(format!("handshake: {e}")))?;
    match hello.op {
        Op::Hello if hello.body_len == NONCE_LEN as u64 => {}
        Op::Err => {
            // E.g. the connection cap: the relay says why and closes.
            let body = read_body(rd, hello.body_len.min(4096) as usize)
                .await
                .map_err(|e| lost(peer, "read failed", e))?;
            let msg = String::from_utf8_lossy(&body).into_owned();
            return Err(reply_error(
                ErrCode::from_u32(hello.arg),
                hello,
                msg,
                peer,
                "",
                Instant::now(),
            ));
        }
        other => {
            return Err(protocol(format!(
                "expected the relay's HELLO, got {other:?} with {} bytes (a relay of another version?)",
                hello.body_len
            )));
        }
    }
    let mut relay_nonce = [0u8; NONCE_LEN];
    rd.read_exact(&mut relay_nonce)
        .await
        .map_err(|e| lost(peer, "read failed", e))?;
    let checks = hello.arg & HELLO_AUTH != 0;
    if secret.is_some() && !checks {
        return Err(unauthorized(
            "the relay does not check the shared secret (it runs with --insecure-no-auth); \
             refusing to use it while a secret is configured",
        ));
    }
    let client_nonce = frame::nonce();
    let mac = secret
        .map(|s| s.client_mac(&relay_nonce, &client_nonce))
        .unwrap_or([0u8; MAC_LEN]);
    let mut auth = Header::new(Op::Auth, 0);
    auth.body_len = AUTH_BODY_LEN as u64;
    let io = async {
        wr.write_all(&auth.encode()).await?;
        wr.write_all(&client_nonce).await?;
        wr.write_all(&mac).await?;
        wr.flush().await
    };
    io.await.map_err(|e| lost(peer, "write failed", e))?;
    let ok = match read_reply(rd, peer, "", Instant::now()).await {
        Ok(Ok(h)) => h,
        Err(KvError::Unauthorized { .. }) | Ok(Err(KvError::Unauthorized { .. })) => {
            return Err(unauthorized(if secret.is_some() {
                "the relay refused our shared secret (the relay and this client have different secrets)"
            } else {
                "the relay requires the shared secret and this client has none"
            }));
        }
        Err(e) | Ok(Err(e)) => return Err(e),
    };
    let expected = if checks { MAC_LEN } else { 0 };
    if ok.body_len != expected as u64 {
        return Err(protocol(format!(
            "handshake reply of {} bytes, expected {expected}",
            ok.body_len
        )));
    }
    let mut proof = [0u8; MAC_LEN];
    rd.read_exact(&mut proof[..expected])
        .await
        .map_err(|e| lost(peer, "read failed", e))?;
    if let Some(secret) = secret
        && !secret.verify_server(&relay_nonce, &client_nonce, &proof)
    {
        return Err(unauthorized(
            "the relay did not prove the shared secret (is it the relay this client is configured for?)",
        ));
    }
    Ok(())
}

/// Runs the client's side of the handshake on a raw connection (tools and
/// tests that speak frames themselves): afterwards the stream carries requests.
pub async fn authenticate(stream: &mut TcpStream, secret: Option<&Secret>) -> Result<(), KvError> {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "the relay".into());
    let (mut rd, mut wr) = stream.split();
    handshake(&mut rd, &mut wr, &peer, secret).await
}
