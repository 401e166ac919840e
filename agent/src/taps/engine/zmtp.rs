//! A ZMTP 3.0 client with NULL security: the wire protocol under every ZMQ socket the
//! agent opens (a SUB on an engine's KV event publisher; a DEALER on a replay socket).
//!
//! Written here rather than taken from a ZMQ library because what a tap needs most is
//! what the libraries lack: a peer must not be able to make the agent allocate what it
//! claims. Every size the peer sends is checked before anything is read for it — a
//! frame's declared length, the running total of a multipart message, its number of
//! frames — and a frame's body is read as it arrives, never reserved up front, so a
//! header claiming 1 TiB costs nothing and a peer sending 2 GiB of an 8 GiB frame costs
//! at most the limit. A peer that breaks a limit or the protocol gets a [`ZmtpError`]
//! naming what it did, and the connection is dropped (the tap counts it and reconnects).
//!
//! The parts that read bytes ([`parse_greeting`], [`FrameDecoder`], [`parse_command`])
//! are pure, unit-tested here and fuzzed (`fuzz/`); [`Connection`] is the thin I/O edge
//! over TCP or a Unix socket. The client speaks ZMTP 3.0, which every libzmq 4.x peer
//! (vLLM through pyzmq, Dynamo through rust-zmq) accepts: subscriptions are sent as
//! messages (`\x01` + topic), and PING commands (3.1 heartbeats) are answered.

use bytes::{Buf, Bytes, BytesMut};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The greeting's length: signature (10), version (2), mechanism (20), as-server (1),
/// filler (31).
pub(crate) const GREETING_LEN: usize = 64;
const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Commands are short (READY, ERROR, PING, PONG); a larger one is refused.
const MAX_COMMAND_BYTES: u64 = 64 * 1024;

/// What a peer may make the client hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest multipart message, all frames together, in bytes.
    pub max_message_bytes: u64,
    /// The most frames in one multipart message.
    pub max_frames: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: 64 * 1024 * 1024,
            max_frames: 16,
        }
    }
}

/// Why a connection ended or could not start. Every variant but [`Self::Io`] and
/// [`Self::Closed`] is the peer's doing.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("bad endpoint {0:?} (expected tcp://HOST:PORT or ipc://PATH)")]
    Endpoint(String),
    #[error("not a ZMTP 3 peer: {0}")]
    Greeting(&'static str),
    #[error("the peer wants security mechanism {0:?}; only NULL is supported")]
    Mechanism(String),
    #[error("the peer is a {peer} socket, which does not talk to a {ours}")]
    SocketType { peer: String, ours: &'static str },
    #[error("frame of {claimed} bytes refused: the limit is {limit} bytes per message")]
    FrameTooLarge { claimed: u64, limit: u64 },
    #[error("message of more than {limit} bytes refused (its frames so far: {so_far} bytes, next {claimed})")]
    MessageTooLarge {
        so_far: u64,
        claimed: u64,
        limit: u64,
    },
    #[error("message of more than {limit} frames refused")]
    TooManyFrames { limit: usize },
    #[error("command of {0} bytes refused")]
    CommandTooLarge(u64),
    #[error("reserved frame flag bits set: {0:#04x}")]
    ReservedFlags(u8),
    #[error("malformed command: {0}")]
    BadCommand(&'static str),
    #[error("the peer sent ERROR: {0}")]
    PeerError(String),
    #[error("the peer sent a message before its READY command")]
    NotReady,
}

impl ZmtpError {
    /// Whether the peer broke the protocol or a limit (counted as its fault), as opposed
    /// to the connection just failing or ending.
    pub(crate) fn is_peer_violation(&self) -> bool {
        !matches!(self, Self::Io(_) | Self::Closed | Self::Endpoint(_))
    }
}

/// The socket type this client plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static str {
        match self {
            Self::Sub => "SUB",
            Self::Dealer => "DEALER",
        }
    }

    /// The peer types ZMQ lets this one talk to.
    fn accepts(self, peer: &str) -> bool {
        match self {
            Self::Sub => matches!(peer, "PUB" | "XPUB"),
            Self::Dealer => matches!(peer, "ROUTER" | "DEALER"),
        }
    }
}

/// Our greeting: ZMTP 3.0, NULL mechanism, client.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The peer's greeting: its (major, minor) version, once checked to be ZMTP 3 or later
/// with the NULL mechanism.
pub fn parse_greeting(g: &[u8; GREETING_LEN]) -> Result<(u8, u8), ZmtpError> {
    if g[0] != 0xff || g[9] & 1 != 1 {
        return Err(ZmtpError::Greeting("bad signature"));
    }
    if g[10] < 3 {
        return Err(ZmtpError::Greeting("version older than 3.0"));
    }
    let mech = &g[12..32];
    let end = mech.iter().position(|&b| b == 0).unwrap_or(mech.len());
    if &mech[..end] != b"NULL" {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mech[..end]).into_owned(),
        ));
    }
    Ok((g[10], g[11]))
}

/// One complete unit read off the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// A multipart message, every frame.
    Message(Vec<Bytes>),
    /// A command frame's body (name and data).
    Command(Bytes),
}

/// Frames out of a byte stream, within [`Limits`]: feed it what was read with
/// [`Self::decode`], which returns the next complete item or `None` while more bytes are
/// needed. A limit is enforced as soon as a frame's header is complete, before its body
/// is read.
#[derive(Debug)]
pub struct FrameDecoder {
    limits: Limits,
    parts: Vec<Bytes>,
    bytes: u64,
    /// The frame being read: (flags, body length), once its header is complete.
    header: Option<(u8, u64)>,
}

impl FrameDecoder {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            parts: Vec::new(),
            bytes: 0,
            header: None,
        }
    }

    /// How many more bytes the next step needs at least (a header's rest or a body's).
    pub(crate) fn wanted(&self, buf: &BytesMut) -> usize {
        match self.header {
            Some((_, len)) => (len as usize).saturating_sub(buf.len()).max(1),
            None => 1,
        }
    }

    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, ZmtpError> {
        loop {
            let (flags, len) = match self.header {
                Some(h) => h,
                None => {
                    let Some(&flags) = buf.first() else {
                        return Ok(None);
                    };
                    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
                        return Err(ZmtpError::ReservedFlags(flags));
                    }
                    let (head, len) = if flags & FLAG_LONG != 0 {
                        if buf.len() < 9 {
                            return Ok(None);
                        }
                        let mut n = [0u8; 8];
                        n.copy_from_slice(&buf[1..9]);
                        (9, u64::from_be_bytes(n))
                    } else {
                        if buf.len() < 2 {
                            return Ok(None);
                        }
                        (2, u64::from(buf[1]))
                    };
                    self.check(flags, len)?;
                    buf.advance(head);
                    self.header = Some((flags, len));
                    (flags, len)
                }
            };
            // `check` bounded `len` by the limits, so it fits in memory and in usize.
            if (buf.len() as u64) < len {
                return Ok(None);
            }
            self.header = None;
            let body = buf.split_to(len as usize).freeze();
            if flags & FLAG_COMMAND != 0 {
                return Ok(Some(Item::Command(body)));
            }
            self.bytes += len;
            self.parts.push(body);
            if flags & FLAG_MORE == 0 {
                self.bytes = 0;
                return Ok(Some(Item::Message(std::mem::take(&mut self.parts))));
            }
        }
    }

    fn check(&self, flags: u8, len: u64) -> Result<(), ZmtpError> {
        if flags & FLAG_COMMAND != 0 {
            if len > MAX_COMMAND_BYTES {
                return Err(ZmtpError::CommandTooLarge(len));
            }
            return Ok(());
        }
        let limit = self.limits.max_message_bytes;
        if len > limit {
            return Err(ZmtpError::FrameTooLarge {
                claimed: len,
                limit,
            });
        }
        if self.bytes + len > limit {
            return Err(ZmtpError::MessageTooLarge {
                so_far: self.bytes,
                claimed: len,
                limit,
            });
        }
        if self.parts.len() >= self.limits.max_frames {
            return Err(ZmtpError::TooManyFrames {
                limit: self.limits.max_frames,
            });
        }
        Ok(())
    }
}

/// A command, split into its name and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `READY` with its metadata properties (name, value).
    Ready(Vec<(String, Bytes)>),
    /// `ERROR` with its reason.
    Error(String),
    /// `PING` (ZMTP 3.1 heartbeat): answered with a `PONG` carrying its context.
    Ping { context: Bytes },
    /// Anything else (`PONG`, `SUBSCRIBE` from a peer, …): ignored.
    Other(String),
}

pub fn parse_command(body: &Bytes) -> Result<Command, ZmtpError> {
    let (&name_len, rest) = body
        .split_first()
        .ok_or(ZmtpError::BadCommand("empty command"))?;
    let name_len = usize::from(name_len);
    if rest.len() < name_len {
        return Err(ZmtpError::BadCommand("name longer than the command"));
    }
    let name = &rest[..name_len];
    let data = body.slice(1 + name_len..);
    Ok(match name {
        b"READY" => Command::Ready(parse_properties(&data)?),
        b"ERROR" => {
            let (&n, reason) = data
                .split_first()
                .ok_or(ZmtpError::BadCommand("ERROR without a reason"))?;
            let reason = reason.get(..usize::from(n)).unwrap_or(reason);
            Command::Error(String::from_utf8_lossy(reason).into_owned())
        }
        b"PING" => {
            if data.len() < 2 {
                return Err(ZmtpError::BadCommand("PING without a TTL"));
            }
            let context = data.slice(2..);
            Command::Ping {
                context: context.slice(..context.len().min(16)),
            }
        }
        other => Command::Other(String::from_utf8_lossy(other).into_owned()),
    })
}

fn parse_properties(mut data: &[u8]) -> Result<Vec<(String, Bytes)>, ZmtpError> {
    let mut props = Vec::new();
    while let Some((&n, rest)) = data.split_first() {
        let n = usize::from(n);
        if rest.len() < n + 4 {
            return Err(ZmtpError::BadCommand("truncated property"));
        }
        let name = String::from_utf8_lossy(&rest[..n]).into_owned();
        let mut len = [0u8; 4];
        len.copy_from_slice(&rest[n..n + 4]);
        let len = u32::from_be_bytes(len) as usize;
        let value = rest.get(n + 4..n + 4 + len).ok_or(ZmtpError::BadCommand(
            "property value longer than the command",
        ))?;
        props.push((name, Bytes::copy_from_slice(value)));
        data = &rest[n + 4 + len..];
    }
    Ok(props)
}

/// A frame header and body: `more` sets the MORE flag.
fn frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    if body.len() > 255 {
        out.push(flags | FLAG_LONG);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

fn ready_command(socket_type: SocketType) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    let name = b"Socket-Type";
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    let value = socket_type.name().as_bytes();
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
    let mut out = Vec::new();
    frame(&mut out, FLAG_COMMAND, &body);
    out
}

/// Something to read from and write to: a TCP or a Unix socket.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// One connection to a peer, after the handshake.
pub struct Connection {
    stream: Box<dyn Stream>,
    decoder: FrameDecoder,
    buf: BytesMut,
    /// The peer's `Socket-Type`.
    pub peer_socket_type: String,
}

/// Read and buffer sizes: a read asks for at least this much room.
const READ_CHUNK: usize = 64 * 1024;

impl Connection {
    /// Connect to `endpoint` (`tcp://HOST:PORT` or `ipc://PATH`) and complete the ZMTP
    /// handshake as a `socket_type`, all within `timeout`.
    pub async fn connect(
        endpoint: &str,
        socket_type: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let stream: Box<dyn Stream> = if let Some(addr) = endpoint.strip_prefix("tcp://") {
            let s = tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
                .await
                .map_err(|_| timed_out("connect"))??;
            s.set_nodelay(true)?;
            keepalive(&s);
            Box::new(s)
        } else if let Some(path) = endpoint.strip_prefix("ipc://") {
            let s = tokio::time::timeout(timeout, tokio::net::UnixStream::connect(path))
                .await
                .map_err(|_| timed_out("connect"))??;
            Box::new(s)
        } else {
            return Err(ZmtpError::Endpoint(endpoint.to_string()));
        };
        tokio::time::timeout(timeout, Self::handshake(stream, socket_type, limits))
            .await
            .map_err(|_| timed_out("the ZMTP handshake"))?
    }

    /// Greetings, then READY both ways, over an open stream.
    pub async fn handshake(
        mut stream: Box<dyn Stream>,
        socket_type: SocketType,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        stream.write_all(&greeting()).await?;
        let mut g = [0u8; GREETING_LEN];
        read_exact(&mut stream, &mut g).await?;
        parse_greeting(&g)?;
        stream.write_all(&ready_command(socket_type)).await?;
        let mut conn = Self {
            stream,
            decoder: FrameDecoder::new(limits),
            buf: BytesMut::new(),
            peer_socket_type: String::new(),
        };
        loop {
            match conn.next_item().await? {
                Item::Command(body) => match parse_command(&body)? {
                    Command::Ready(props) => {
                        let peer = props
                            .iter()
                            .find(|(k, _)| k.eq_ignore_ascii_case("Socket-Type"))
                            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                            .unwrap_or_default();
                        if !socket_type.accepts(&peer) {
                            return Err(ZmtpError::SocketType {
                                peer,
                                ours: socket_type.name(),
                            });
                        }
                        conn.peer_socket_type = peer;
                        return Ok(conn);
                    }
                    Command::Error(reason) => return Err(ZmtpError::PeerError(reason)),
                    _ => {}
                },
                Item::Message(_) => return Err(ZmtpError::NotReady),
            }
        }
    }

    /// Subscribe to messages starting with `topic` (a SUB's subscription message).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        let mut body = Vec::with_capacity(topic.len() + 1);
        body.push(1);
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// Send one multipart message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            frame(&mut out, more, f);
        }
        self.stream.write_all(&out).await?;
        Ok(())
    }

    /// The next multipart message; commands in between are handled (PING answered,
    /// ERROR ends the connection).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            match self.next_item().await? {
                Item::Message(m) => return Ok(m),
                Item::Command(body) => match parse_command(&body)? {
                    Command::Ping { context } => {
                        let mut pong = vec![4];
                        pong.extend_from_slice(b"PONG");
                        pong.extend_from_slice(&context);
                        let mut out = Vec::new();
                        frame(&mut out, FLAG_COMMAND, &pong);
                        self.stream.write_all(&out).await?;
                    }
                    Command::Error(reason) => return Err(ZmtpError::PeerError(reason)),
                    Command::Ready(_) | Command::Other(_) => {}
                },
            }
        }
    }

    async fn next_item(&mut self) -> Result<Item, ZmtpError> {
        loop {
            if let Some(item) = self.decoder.decode(&mut self.buf)? {
                return Ok(item);
            }
            // Room for what the frame still needs, in steps, so a claimed size is never
            // reserved before its bytes arrive.
            let want = self.decoder.wanted(&self.buf).clamp(4096, READ_CHUNK);
            self.buf.reserve(want);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
    }
}

async fn read_exact(stream: &mut Box<dyn Stream>, buf: &mut [u8]) -> Result<(), ZmtpError> {
    match stream.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(ZmtpError::Closed),
        Err(e) => Err(e.into()),
    }
}

fn timed_out(what: &str) -> ZmtpError {
    ZmtpError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} timed out"),
    ))
}

/// A publisher that vanishes without closing (a node lost) is noticed within about a
/// minute instead of never.
fn keepalive(s: &tokio::net::TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    let _ = socket2::SockRef::from(s).set_tcp_keepalive(&ka);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_message_bytes: u64, max_frames: usize) -> Limits {
        Limits {
            max_message_bytes,
            max_frames,
        }
    }

    fn encode(frames: &[&[u8]]) -> BytesMut {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            frame(
                &mut out,
                if i + 1 < frames.len() { FLAG_MORE } else { 0 },
                f,
            );
        }
        BytesMut::from(&out[..])
    }

    #[test]
    fn messages_come_out_whole_whatever_the_read_sizes() {
        let long = vec![7u8; 300];
        let wire = encode(&[b"", &5u64.to_be_bytes(), &long]);
        for step in [1, 2, 7, 64, wire.len()] {
            let mut d = FrameDecoder::new(Limits::default());
            let mut buf = BytesMut::new();
            let mut got = Vec::new();
            for chunk in wire.chunks(step) {
                buf.extend_from_slice(chunk);
                while let Some(item) = d.decode(&mut buf).unwrap() {
                    got.push(item);
                }
            }
            assert_eq!(
                got,
                vec![Item::Message(vec![
                    Bytes::new(),
                    Bytes::copy_from_slice(&5u64.to_be_bytes()),
                    Bytes::from(long.clone())
                ])],
                "read in steps of {step}"
            );
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn a_claimed_size_over_the_limit_is_refused_from_its_header_alone() {
        // 1 TiB claimed, no body sent: refused with nothing allocated for it.
        let mut buf = BytesMut::from(&[FLAG_LONG][..]);
        buf.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let err = FrameDecoder::new(limits(1 << 20, 16))
            .decode(&mut buf)
            .unwrap_err();
        assert!(matches!(
            err,
            ZmtpError::FrameTooLarge {
                claimed,
                limit: 1048576
            } if claimed == 1 << 40
        ));
        assert!(err.is_peer_violation());
        // Frames within the limit one by one, over it together.
        let mut buf = encode(&[&[0u8; 600], &[0u8; 600]]);
        let err = FrameDecoder::new(limits(1000, 16))
            .decode(&mut buf)
            .unwrap_err();
        assert!(matches!(
            err,
            ZmtpError::MessageTooLarge {
                so_far: 600,
                claimed: 600,
                limit: 1000
            }
        ));
        let mut buf = encode(&[b"a", b"b", b"c"]);
        assert!(matches!(
            FrameDecoder::new(limits(1000, 2)).decode(&mut buf),
            Err(ZmtpError::TooManyFrames { limit: 2 })
        ));
        let mut buf = BytesMut::from(&[0x08u8, 0][..]);
        assert!(matches!(
            FrameDecoder::new(Limits::default()).decode(&mut buf),
            Err(ZmtpError::ReservedFlags(8))
        ));
    }

    #[test]
    fn the_message_limit_is_per_message() {
        let mut d = FrameDecoder::new(limits(10, 16));
        let mut buf = encode(&[&[1u8; 6]]);
        buf.extend_from_slice(&encode(&[&[2u8; 6]]));
        assert!(matches!(d.decode(&mut buf), Ok(Some(Item::Message(_)))));
        assert!(matches!(d.decode(&mut buf), Ok(Some(Item::Message(_)))));
    }

    #[test]
    fn greetings_and_commands() {
        assert_eq!(parse_greeting(&greeting()).unwrap(), (3, 0));
        let mut g = greeting();
        g[10] = 2;
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::Greeting(_))));
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        assert!(matches!(parse_greeting(&g), Err(ZmtpError::Mechanism(m)) if m == "CURVE"));
        let mut g = greeting();
        g[0] = 0;
        assert!(parse_greeting(&g).is_err());

        let mut buf = BytesMut::from(&ready_command(SocketType::Sub)[..]);
        let Some(Item::Command(body)) = FrameDecoder::new(Limits::default())
            .decode(&mut buf)
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(
            parse_command(&body).unwrap(),
            Command::Ready(vec![("Socket-Type".into(), Bytes::from_static(b"SUB"))])
        );
        let ping = Bytes::from_static(b"\x04PING\x00\x10ctx");
        assert_eq!(
            parse_command(&ping).unwrap(),
            Command::Ping {
                context: Bytes::from_static(b"ctx")
            }
        );
        let err = Bytes::from_static(b"\x05ERROR\x04nope");
        assert_eq!(parse_command(&err).unwrap(), Command::Error("nope".into()));
        for bad in [
            &b""[..],
            b"\x09READY",
            b"\x05READY\x0bSocket-Type\x00\x00\x00\x09SUB",
            b"\x04PING\x00",
        ] {
            assert!(
                parse_command(&Bytes::copy_from_slice(bad)).is_err(),
                "{bad:?}"
            );
        }
        assert!(SocketType::Sub.accepts("PUB") && !SocketType::Sub.accepts("ROUTER"));
        assert!(SocketType::Dealer.accepts("ROUTER"));
    }
}
