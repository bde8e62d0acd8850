//! The job-token rendezvous of a launch without MPI: rank 0 hands its `ncclUniqueId` to the
//! other ranks over one TCP connection each, at `MASTER_ADDR:(MASTER_PORT + 1)`.
//!
//! Why not NCCL's own `NCCL_COMM_ID` bootstrap: its root checks only a fixed magic, so a stale
//! rank or another job that reaches the address is let in; and the variable is process-wide
//! (it forces every later NCCL communicator of the process, torch.distributed's too, onto that
//! address, and setting it races with other threads' `getenv`). Here rank 0 makes a plain id
//! (random magic) and gives it only to peers that present the job's token.
//!
//! # Protocol (version 1)
//!
//! Each rank other than 0 connects (retrying while nothing listens) and sends a hello:
//! `"kvs-rdzv"`, the version (u16), the token's length (u16) and bytes, its rank (u32) and the
//! world size (u32), all little-endian. Rank 0 checks the token first, then the version, the
//! world size, and that the rank is in `1..size` and not taken; a peer that fails a check gets a
//! refusal (`"kvs-rdzv"`, a nonzero code, a u16 length and a message) and is not counted. Once
//! every rank has said hello, rank 0 makes the id, sends each peer `"kvs-rdzv"`, a zero and the
//! 128 bytes, and closes the listener. A peer that says nothing within [`HELLO_WAIT`], sends
//! something else, or hangs up before the id is sent is dropped (its rank may connect again).
//! Every wait ends at the deadline the caller gives (`KVSTORE_TIMEOUT` for the bootstrap).
//!
//! # What it trusts
//!
//! The token is `TORCHELASTIC_RUN_ID` (torchrun's `--rdzv-id`, fresh per job with
//! `--standalone`) when set, else `KVSTORE_JOB_TOKEN`, else a fixed default, with which any
//! peer that speaks this protocol is accepted (as `NCCL_COMM_ID` accepts any). It travels in
//! clear text: it keeps jobs apart; it is no secret from someone who can read the network.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The length of an `ncclUniqueId`.
pub(crate) const ID_LEN: usize = 128;

/// The first bytes of every hello and reply.
const MAGIC: [u8; 8] = *b"kvs-rdzv";
/// The protocol version this build speaks.
const VERSION: u16 = 1;
/// The longest token accepted, in bytes.
const MAX_TOKEN: usize = 1024;
/// The token when neither variable is set.
const DEFAULT_TOKEN: &str = "kvstore-default-job";
/// How long rank 0 waits for the hello of a peer that connected.
pub(crate) const HELLO_WAIT: Duration = Duration::from_secs(5);
/// How long a peer waits between tries to connect.
const RETRY: Duration = Duration::from_millis(50);
/// How long rank 0 sleeps when nothing happened.
const POLL: Duration = Duration::from_millis(5);
/// The name of the operation in errors.
const OP: &str = "NCCL rendezvous";
/// The most connections rank 0 waits on for a hello at once.
const MAX_PENDING: usize = 256;
/// The most refusals rank 0 remembers for its timeout's message.
const MAX_REFUSED: usize = 8;

/// Why rank 0 refused a peer (the code of a refusal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Refusal {
    Token = 1,
    Version = 2,
    WorldSize = 3,
    Rank = 4,
    Rank0Failed = 5,
}

impl Refusal {
    fn from_code(code: u8) -> Option<Refusal> {
        use Refusal::*;
        [Token, Version, WorldSize, Rank, Rank0Failed]
            .into_iter()
            .find(|r| *r as u8 == code)
    }
}

/// The token that marks the ranks of one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct JobToken {
    /// The variable it was read from (`KVSTORE_JOB_TOKEN` for the default: where to set one).
    pub var: &'static str,
    /// The token.
    pub value: String,
    /// Whether it is the fixed default (neither variable set).
    pub default: bool,
}

impl JobToken {
    /// The token of this process's environment.
    pub(super) fn from_process() -> Result<JobToken> {
        JobToken::from_vars(|k| std::env::var(k).ok())
    }

    /// `TORCHELASTIC_RUN_ID` when set and not empty, else `KVSTORE_JOB_TOKEN`, else the default.
    pub(super) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<JobToken> {
        for name in ["TORCHELASTIC_RUN_ID", "KVSTORE_JOB_TOKEN"] {
            let Some(value) = var(name).filter(|v| !v.is_empty()) else {
                continue;
            };
            if value.len() > MAX_TOKEN {
                return Err(Error::dist_env(
                    name,
                    format!(
                        "is {} bytes long: a job token has at most {MAX_TOKEN}",
                        value.len()
                    ),
                ));
            }
            return Ok(JobToken {
                var: name,
                value,
                default: false,
            });
        }
        Ok(JobToken {
            var: "KVSTORE_JOB_TOKEN",
            value: DEFAULT_TOKEN.to_owned(),
            default: true,
        })
    }

    /// Whether `other` is this token (in time independent of where they differ).
    fn matches(&self, other: &[u8]) -> bool {
        let mine = self.value.as_bytes();
        mine.len() == other.len() && mine.iter().zip(other).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }

    /// Says where the token comes from, for errors.
    fn describe(&self) -> String {
        if self.default {
            "the default token (neither TORCHELASTIC_RUN_ID nor KVSTORE_JOB_TOKEN is set)"
                .to_owned()
        } else {
            format!("the token from {}", self.var)
        }
    }
}

/// A host as `to_socket_addrs` takes it: IPv6 brackets removed.
fn bare_host(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// The time left before `deadline`, at least a millisecond (socket timeouts refuse zero).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

/// Rank 0's side: a listener at the rendezvous address.
pub(crate) struct Root {
    listener: TcpListener,
    /// `host:port`, for messages.
    addr: String,
}

/// A connection whose hello has not all arrived yet.
struct Pending {
    stream: TcpStream,
    buf: Vec<u8>,
    since: Instant,
    peer: String,
}

impl Root {
    /// Listens at `host:port` (or at the unspecified address of its family when `host` is not
    /// this machine's). A port in use is an [`Error::DistEnv`] naming `MASTER_PORT`.
    pub(super) fn bind(host: &str, port: u16) -> Result<Root> {
        let addr = format!("{host}:{port}");
        let addrs: Vec<SocketAddr> = (bare_host(host), port)
            .to_socket_addrs()
            .map_err(|e| {
                Error::dist_env(
                    "MASTER_ADDR",
                    format!(
                        "'{host}' does not resolve on rank 0 ({e}): use rank 0's host name or \
                         address"
                    ),
                )
            })?
            .collect();
        let mut last = None;
        for a in &addrs {
            match TcpListener::bind(a) {
                Ok(listener) => return Root::ready(listener, addr),
                Err(e) if e.kind() == ErrorKind::AddrNotAvailable => {
                    // Not an address of this machine (NAT, a load balancer): listen on every
                    // address of the family, as torch's TCPStore does.
                    let any = match a.ip() {
                        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
                    };
                    match TcpListener::bind(SocketAddr::new(any, port)) {
                        Ok(listener) => return Root::ready(listener, addr),
                        Err(e) => last = Some(e),
                    }
                }
                Err(e) => last = Some(e),
            }
        }
        let why = last.map_or_else(|| "no address".to_owned(), |e| e.to_string());
        Err(Error::dist_env(
            "MASTER_PORT",
            format!(
                "rank 0 cannot listen at {addr} (MASTER_PORT + 1), where kvstore hands the \
                 NCCL id to the other ranks: {why}. Another program, or a rank of an earlier \
                 job, uses that port: pick a MASTER_PORT whose next port is free too"
            ),
        ))
    }

    fn ready(listener: TcpListener, addr: String) -> Result<Root> {
        listener.set_nonblocking(true).map_err(|e| {
            Error::dist_env("MASTER_PORT", format!("rank 0's listener at {addr}: {e}"))
        })?;
        Ok(Root { listener, addr })
    }

    /// The port it listens on (the one asked for, or the one the system picked for port 0).
    #[cfg(test)]
    pub(super) fn port(&self) -> u16 {
        self.listener.local_addr().map_or(0, |a| a.port())
    }

    /// Waits until ranks `1..size` have each said hello with `token` (refusing, and not
    /// counting, peers that fail a check), then sends them the id `make_id` makes, closes the
    /// listener and returns the id. After `deadline`, an [`Error::Timeout`] names the ranks
    /// that never came; if `make_id` fails, the peers are told, and its error is returned.
    pub(super) fn serve(
        self,
        token: &JobToken,
        size: usize,
        deadline: Instant,
        make_id: impl FnOnce() -> Result<[u8; ID_LEN]>,
    ) -> Result<[u8; ID_LEN]> {
        let mut pending: Vec<Pending> = Vec::new();
        let mut joined: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let mut refused: Vec<String> = Vec::new();
        while joined.iter().skip(1).any(Option::is_none) {
            if Instant::now() > deadline {
                let e = self.timeout(&joined, &refused);
                refuse_all(joined.iter().flatten(), &format!("rank 0 gave up: {e}"));
                return Err(e);
            }
            let mut busy = false;
            // At most a round of connections at a time, so the deadline is checked however
            // many arrive.
            for _ in 0..64 {
                match self.listener.accept() {
                    Ok((stream, peer)) => {
                        busy = true;
                        // A flood of connections is dropped beyond a bound (the real ranks
                        // retry until the deadline); so is one that cannot be made non-blocking.
                        if pending.len() < MAX_PENDING && stream.set_nonblocking(true).is_ok() {
                            pending.push(Pending {
                                stream,
                                buf: Vec::new(),
                                since: Instant::now(),
                                peer: peer.to_string(),
                            });
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    // A connection that failed while queued (reset by its peer): the next.
                    Err(_) => break,
                }
            }
            let mut still = Vec::with_capacity(pending.len());
            for mut p in pending.drain(..) {
                match read_hello(&mut p) {
                    Hello::More if p.since.elapsed() > HELLO_WAIT => {
                        log::warn!(
                            "kvstore: {OP}: {} connected to {} and sent no hello within \
                             {HELLO_WAIT:?}; dropped",
                            p.peer,
                            self.addr
                        );
                    }
                    Hello::More => still.push(p),
                    Hello::Garbage => {
                        busy = true;
                        refused.push(format!("{} (not a kvstore rank)", p.peer));
                    }
                    Hello::Done(h) => {
                        busy = true;
                        match check(&h, token, size, &joined) {
                            Ok(rank) => joined[rank] = Some(p.stream),
                            Err((code, why)) => {
                                log::warn!("kvstore: {OP}: refused {}: {why}", p.peer);
                                refused.push(format!("{} ({why})", p.peer));
                                refuse(&p.stream, code, &why);
                            }
                        }
                    }
                }
            }
            pending = still;
            if refused.len() > MAX_REFUSED {
                refused.drain(..refused.len() - MAX_REFUSED);
            }
            // A peer that hung up after its hello (it failed, or was restarted) frees its rank.
            for (rank, slot) in joined.iter_mut().enumerate().skip(1) {
                if slot.as_ref().is_some_and(hung_up) {
                    log::warn!(
                        "kvstore: {OP}: rank {rank} hung up before the NCCL id was ready; \
                         waiting for it again"
                    );
                    *slot = None;
                    busy = true;
                }
            }
            if !busy {
                std::thread::sleep(POLL);
            }
        }
        drop(pending);
        let peers: Vec<TcpStream> = joined.into_iter().flatten().collect();
        let id = match make_id() {
            Ok(id) => id,
            Err(e) => {
                refuse_all(&peers, &format!("rank 0 could not make the NCCL id: {e}"));
                return Err(e);
            }
        };
        let reply = [&MAGIC[..], &[0], &id].concat();
        for s in &peers {
            if let Err(e) = send(s, &reply, left(deadline).min(HELLO_WAIT)) {
                // Its rank will not join the communicator: NCCL's init times out instead.
                log::warn!("kvstore: {OP}: sending the NCCL id to a rank failed: {e}");
            }
        }
        // The listener closes here: a late or stale peer finds nothing.
        Ok(id)
    }

    /// The error of a rendezvous whose deadline passed.
    fn timeout(&self, joined: &[Option<TcpStream>], refused: &[String]) -> Error {
        let missing: Vec<usize> = (1..joined.len()).filter(|&r| joined[r].is_none()).collect();
        let last: Vec<&str> = refused.iter().rev().take(4).map(String::as_str).collect();
        let refusals = match last.is_empty() {
            true => String::new(),
            false => format!("; refused meanwhile: {}", last.join(", ")),
        };
        Error::Timeout {
            op: OP,
            seq: 0,
            keys: vec![],
            missing,
            detail: format!(
                "rank 0 listened at {} until KVSTORE_TIMEOUT passed; every rank must start \
                 with the same MASTER_ADDR, MASTER_PORT, WORLD_SIZE and job token \
                 (TORCHELASTIC_RUN_ID or KVSTORE_JOB_TOKEN){refusals}",
                self.addr
            ),
        }
    }
}

/// A peer's hello, decoded.
struct HelloMsg {
    version: u16,
    token: Vec<u8>,
    rank: usize,
    size: usize,
}

enum Hello {
    /// Not all of it has arrived.
    More,
    /// Not a hello, or the peer hung up.
    Garbage,
    Done(HelloMsg),
}

/// Reads what has arrived of `p`'s hello, without blocking.
fn read_hello(p: &mut Pending) -> Hello {
    loop {
        let want = match hello_len(&p.buf) {
            Ok(n) => n,
            Err(()) => return Hello::Garbage,
        };
        if p.buf.len() == want {
            return decode_hello(&p.buf).map_or(Hello::Garbage, Hello::Done);
        }
        let mut chunk = vec![0u8; want - p.buf.len()];
        match p.stream.read(&mut chunk) {
            Ok(0) => return Hello::Garbage,
            Ok(n) => p.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Hello::More,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Hello::Garbage,
        }
    }
}

/// How long the hello whose first bytes are `buf` is (as far as known yet), or `Err` when they
/// are not a hello.
fn hello_len(buf: &[u8]) -> std::result::Result<usize, ()> {
    const HEAD: usize = 12;
    let n = buf.len().min(MAGIC.len());
    if buf[..n] != MAGIC[..n] {
        return Err(());
    }
    if buf.len() < HEAD {
        return Ok(HEAD);
    }
    let token = u16::from_le_bytes([buf[10], buf[11]]) as usize;
    if token > MAX_TOKEN {
        return Err(());
    }
    Ok(HEAD + token + 8)
}

fn decode_hello(buf: &[u8]) -> Option<HelloMsg> {
    let token_len = u16::from_le_bytes([buf[10], buf[11]]) as usize;
    let rest = buf.get(12 + token_len..)?;
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = rest.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_le_bytes(b) as usize)
    };
    Some(HelloMsg {
        version: u16::from_le_bytes([buf[8], buf[9]]),
        token: buf[12..12 + token_len].to_vec(),
        rank: word(0)?,
        size: word(4)?,
    })
}

fn encode_hello(token: &JobToken, rank: usize, size: usize) -> Vec<u8> {
    let t = token.value.as_bytes();
    let mut out = Vec::with_capacity(12 + t.len() + 8);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    // The token's length was checked against MAX_TOKEN when it was read.
    out.extend_from_slice(&(t.len() as u16).to_le_bytes());
    out.extend_from_slice(t);
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    out.extend_from_slice(&(size as u32).to_le_bytes());
    out
}

/// Rank 0's checks of a hello: the peer's rank, or why it is refused. The token comes first,
/// so a peer of another job learns nothing else.
fn check(
    h: &HelloMsg,
    token: &JobToken,
    size: usize,
    joined: &[Option<TcpStream>],
) -> std::result::Result<usize, (Refusal, String)> {
    if !token.matches(&h.token) {
        return Err((
            Refusal::Token,
            "its job token differs from rank 0's".to_owned(),
        ));
    }
    if h.version != VERSION {
        return Err((
            Refusal::Version,
            format!(
                "it speaks rendezvous version {}, rank 0 version {VERSION}: every rank must \
                 run the same kvstore",
                h.version
            ),
        ));
    }
    if h.size != size {
        return Err((
            Refusal::WorldSize,
            format!("it says WORLD_SIZE {}, rank 0 says {size}", h.size),
        ));
    }
    if h.rank == 0 || h.rank >= size {
        return Err((
            Refusal::Rank,
            format!(
                "it says RANK {}, but the other ranks run from 1 to {}",
                h.rank,
                size - 1
            ),
        ));
    }
    if joined[h.rank].is_some() {
        return Err((
            Refusal::Rank,
            format!(
                "rank {} has already joined: two processes were started with RANK={}",
                h.rank, h.rank
            ),
        ));
    }
    Ok(h.rank)
}

/// Sends a refusal, as far as the peer takes it in a second (it is dropped either way).
fn refuse(stream: &TcpStream, code: Refusal, why: &str) {
    let why = &why.as_bytes()[..why.len().min(4096)];
    let len = (why.len() as u16).to_le_bytes();
    let out = [&MAGIC[..], &[code as u8], &len, why].concat();
    let _ = send(stream, &out, Duration::from_secs(1));
}

/// Refuses every one of `streams` with [`Refusal::Rank0Failed`] and `why`.
fn refuse_all<'a>(streams: impl IntoIterator<Item = &'a TcpStream>, why: &str) {
    for s in streams {
        refuse(s, Refusal::Rank0Failed, why);
    }
}

/// Sends `bytes` on `stream`, blocking at most `wait`.
fn send(mut stream: &TcpStream, bytes: &[u8], wait: Duration) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(wait))?;
    stream.write_all(bytes)
}

/// Whether a peer that said hello has hung up (or sent more than its hello), without blocking.
fn hung_up(stream: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    match stream.peek(&mut b) {
        Ok(_) => true,
        Err(e) => e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted,
    }
}

/// A non-zero rank's side: connects to rank 0 at `host:port` (retrying until `deadline`),
/// says hello with `token`, and returns the id rank 0 sends. A refusal is an
/// [`Error::DistEnv`] naming the variable to fix; no answer by `deadline`, [`Error::Timeout`].
pub(crate) fn fetch(
    host: &str,
    port: u16,
    token: &JobToken,
    rank: usize,
    size: usize,
    deadline: Instant,
) -> Result<[u8; ID_LEN]> {
    let addr = format!("{host}:{port}");
    let timeout = |what: String| Error::Timeout {
        op: OP,
        seq: 0,
        keys: vec![],
        missing: vec![0],
        detail: format!(
            "{what} (KVSTORE_TIMEOUT); rank 0 listens at MASTER_ADDR:(MASTER_PORT + 1) once it \
             starts: check that it runs and that every rank has the same MASTER_ADDR and \
             MASTER_PORT"
        ),
    };
    let mut last = String::from("no try yet");
    let mut stream = loop {
        if Instant::now() > deadline {
            return Err(timeout(format!(
                "rank {rank} could not reach rank 0 at {addr} (last: {last})"
            )));
        }
        match (bare_host(host), port).to_socket_addrs() {
            Ok(mut addrs) => {
                let connect = |a| TcpStream::connect_timeout(&a, left(deadline).min(HELLO_WAIT));
                let got = addrs.find_map(|a| connect(a).map_err(|e| last = e.to_string()).ok());
                if let Some(s) = got {
                    break s;
                }
            }
            Err(e) => last = format!("'{host}' does not resolve: {e}"),
        }
        std::thread::sleep(RETRY.min(left(deadline)));
    };
    let io = |e: std::io::Error| -> Error {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            timeout(format!(
                "rank {rank} reached rank 0 at {addr}, but rank 0 sent no NCCL id before the \
                 deadline (it waits for every rank to connect)"
            ))
        } else if e.kind() == ErrorKind::UnexpectedEof {
            Error::RankExited {
                op: OP,
                seq: 0,
                rank: 0,
                host: Some(host.to_owned()),
                detail: format!(
                    "closed the connection at {addr} before sending the NCCL id (it failed or \
                     exited, or what listens there is not a kvstore rank 0)"
                ),
            }
        } else {
            Error::dist_env(
                "MASTER_ADDR",
                format!("the rendezvous with rank 0 at {addr} failed: {e}"),
            )
        }
    };
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(Some(left(deadline).min(HELLO_WAIT)))
        .and_then(|()| stream.write_all(&encode_hello(token, rank, size)))
        .map_err(io)?;
    let mut head = [0u8; MAGIC.len() + 1];
    read_full(&mut stream, &mut head, deadline).map_err(io)?;
    if head[..MAGIC.len()] != MAGIC {
        return Err(Error::dist_env(
            "MASTER_PORT",
            format!(
                "what answers at {addr} (MASTER_PORT + 1) is not a kvstore rank 0: pick a \
                 MASTER_PORT whose next port is free"
            ),
        ));
    }
    let code = head[MAGIC.len()];
    if code == 0 {
        let mut id = [0u8; ID_LEN];
        read_full(&mut stream, &mut id, deadline).map_err(io)?;
        return Ok(id);
    }
    let mut len = [0u8; 2];
    read_full(&mut stream, &mut len, deadline).map_err(io)?;
    let mut why = vec![0u8; u16::from_le_bytes(len) as usize];
    read_full(&mut stream, &mut why, deadline).map_err(io)?;
    let why = String::from_utf8_lossy(&why);
    Err(match Refusal::from_code(code) {
        Some(Refusal::Token) => Error::dist_env(
            token.var,
            format!(
                "rank 0 at {addr} refused this rank: {why}. This rank uses {}. Rank 0 belongs \
                 to another job (a rank of an earlier job still running, or two jobs on one \
                 MASTER_ADDR:MASTER_PORT): give every rank of a job the same \
                 TORCHELASTIC_RUN_ID or KVSTORE_JOB_TOKEN, and each job its own MASTER_PORT",
                token.describe()
            ),
        ),
        Some(r @ (Refusal::WorldSize | Refusal::Rank)) => {
            let var = if r == Refusal::Rank {
                "RANK"
            } else {
                "WORLD_SIZE"
            };
            Error::dist_env(var, format!("rank 0 at {addr} refused this rank: {why}"))
        }
        Some(Refusal::Rank0Failed) => Error::RankExited {
            op: OP,
            seq: 0,
            rank: 0,
            host: Some(host.to_owned()),
            detail: format!("failed before sending the NCCL id ({why})"),
        },
        Some(Refusal::Version) | None => Error::dist_env(
            "MASTER_PORT",
            format!(
                "rank 0 at {addr} refused this rank (code {code}): {why}; every rank must run \
                 the same kvstore"
            ),
        ),
    })
}

/// Reads exactly `buf.len()` bytes, each read bounded by what is left until `deadline`.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        if Instant::now() > deadline {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left(deadline)))?;
        match stream.read(&mut buf[at..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => at += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn token(v: &str) -> JobToken {
        JobToken::from_vars(|k| (k == "KVSTORE_JOB_TOKEN").then(|| v.to_owned())).unwrap()
    }

    fn fresh_id() -> [u8; ID_LEN] {
        let mut id = [0u8; ID_LEN];
        id.iter_mut().for_each(|b| *b = rand::random());
        id
    }

    /// Rank 0 on a port of its own; its result comes back on the channel.
    fn root(
        tok: JobToken,
        size: usize,
        limit: Duration,
        id: [u8; ID_LEN],
    ) -> (u16, mpsc::Receiver<Result<[u8; ID_LEN]>>) {
        let r = Root::bind("127.0.0.1", 0).unwrap();
        let port = r.port();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(r.serve(&tok, size, Instant::now() + limit, || Ok(id)));
        });
        (port, rx)
    }

    #[test]
    fn the_token_comes_from_torchelastic_then_kvstore_then_the_default() {
        let both = |k: &str| match k {
            "TORCHELASTIC_RUN_ID" => Some("elastic".to_owned()),
            "KVSTORE_JOB_TOKEN" => Some("mine".to_owned()),
            _ => None,
        };
        let t = JobToken::from_vars(both).unwrap();
        assert_eq!(
            (t.var, t.value.as_str(), t.default),
            ("TORCHELASTIC_RUN_ID", "elastic", false)
        );
        let t = token("mine");
        assert_eq!(
            (t.var, t.value.as_str(), t.default),
            ("KVSTORE_JOB_TOKEN", "mine", false)
        );
        let t = JobToken::from_vars(|_| Some(String::new())).unwrap();
        assert!(t.default, "empty variables count as unset");
        let long = "x".repeat(MAX_TOKEN + 1);
        let e =
            JobToken::from_vars(|k| (k == "KVSTORE_JOB_TOKEN").then(|| long.clone())).unwrap_err();
        assert!(
            matches!(e, Error::DistEnv { ref var, .. } if var == "KVSTORE_JOB_TOKEN"),
            "{e}"
        );
    }

    #[test]
    fn every_rank_gets_rank_0s_id() {
        let id = fresh_id();
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let size = 4;
        let (port, rx) = root(tok.clone(), size, Duration::from_secs(30), id);
        let peers: Vec<_> = (1..size)
            .map(|r| {
                let tok = tok.clone();
                std::thread::spawn(move || {
                    fetch(
                        "127.0.0.1",
                        port,
                        &tok,
                        r,
                        size,
                        Instant::now() + Duration::from_secs(30),
                    )
                })
            })
            .collect();
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), id);
        }
        assert_eq!(rx.recv().unwrap().unwrap(), id);
    }

    #[test]
    fn a_peer_of_another_job_is_refused_and_the_job_still_forms() {
        let id = fresh_id();
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let (port, rx) = root(tok.clone(), 2, Duration::from_secs(30), id);
        let deadline = Instant::now() + Duration::from_secs(30);
        let other = token(&format!("other-{}", rand::random::<u64>()));
        let e = fetch("127.0.0.1", port, &other, 1, 2, deadline).unwrap_err();
        match &e {
            Error::DistEnv { var, message } => {
                assert_eq!(var, "KVSTORE_JOB_TOKEN");
                assert!(message.contains("another job"), "{message}");
            }
            other => panic!("expected DistEnv, got {other:?}"),
        }
        // A peer of the default token is another job too.
        let e = fetch("127.0.0.1", port, &token(""), 1, 2, deadline).unwrap_err();
        assert!(e.to_string().contains("default token"), "{e}");
        assert_eq!(fetch("127.0.0.1", port, &tok, 1, 2, deadline).unwrap(), id);
        assert_eq!(rx.recv().unwrap().unwrap(), id);
    }

    #[test]
    fn wrong_sizes_ranks_and_duplicates_are_refused_naming_their_variable() {
        let id = fresh_id();
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let (port, rx) = root(tok.clone(), 3, Duration::from_secs(30), id);
        let deadline = Instant::now() + Duration::from_secs(30);
        let var = |e: Error| match e {
            Error::DistEnv { var, .. } => var,
            other => panic!("expected DistEnv, got {other:?}"),
        };
        assert_eq!(
            var(fetch("127.0.0.1", port, &tok, 1, 4, deadline).unwrap_err()),
            "WORLD_SIZE"
        );
        assert_eq!(
            var(fetch("127.0.0.1", port, &tok, 3, 3, deadline).unwrap_err()),
            "RANK"
        );
        assert_eq!(
            var(fetch("127.0.0.1", port, &tok, 0, 3, deadline).unwrap_err()),
            "RANK"
        );
        // Rank 1 joins and waits (by hand, so it is surely first); a second rank 1 is refused.
        let mut first = TcpStream::connect(("127.0.0.1", port)).unwrap();
        first.write_all(&encode_hello(&tok, 1, 3)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let e = fetch("127.0.0.1", port, &tok, 1, 3, deadline).unwrap_err();
        match e {
            Error::DistEnv { var, message } => {
                assert_eq!(var, "RANK");
                assert!(message.contains("already joined"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(fetch("127.0.0.1", port, &tok, 2, 3, deadline).unwrap(), id);
        let mut reply = [0u8; MAGIC.len() + 1 + ID_LEN];
        read_full(&mut first, &mut reply, deadline).unwrap();
        assert_eq!((&reply[..MAGIC.len()], reply[MAGIC.len()]), (&MAGIC[..], 0));
        assert_eq!(reply[MAGIC.len() + 1..], id);
        assert_eq!(rx.recv().unwrap().unwrap(), id);
    }

    #[test]
    fn silent_and_garbage_connections_do_not_stop_rank_0() {
        let id = fresh_id();
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let (port, rx) = root(tok.clone(), 2, Duration::from_secs(30), id);
        // One says nothing, one speaks another protocol; both stay open.
        let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let start = Instant::now();
        assert_eq!(fetch("127.0.0.1", port, &tok, 1, 2, deadline).unwrap(), id);
        assert!(
            start.elapsed() < HELLO_WAIT,
            "the silent peer held rank 0 up"
        );
        assert_eq!(rx.recv().unwrap().unwrap(), id);
    }

    #[test]
    fn ranks_that_never_come_are_a_timeout_on_both_sides() {
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let (port, rx) = root(tok.clone(), 3, Duration::from_millis(600), fresh_id());
        let peer = {
            let tok = tok.clone();
            std::thread::spawn(move || {
                fetch(
                    "127.0.0.1",
                    port,
                    &tok,
                    2,
                    3,
                    Instant::now() + Duration::from_millis(600),
                )
            })
        };
        match rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap()
            .unwrap_err()
        {
            Error::Timeout { missing, .. } => assert_eq!(missing, vec![1]),
            other => panic!("{other:?}"),
        }
        // Rank 2 was accepted; when rank 0 gave up, it said so.
        let e = peer.join().unwrap().unwrap_err();
        assert!(
            matches!(e, Error::RankExited { rank: 0, .. } | Error::Timeout { .. }),
            "{e:?}"
        );
        // Nobody listens any more: a peer now times out trying to connect.
        let start = Instant::now();
        let e = fetch(
            "127.0.0.1",
            port,
            &tok,
            1,
            3,
            Instant::now() + Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(
            matches!(e, Error::Timeout { ref missing, .. } if missing == &[0]),
            "{e:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn a_failure_to_make_the_id_reaches_every_peer() {
        let tok = token(&format!("job-{}", rand::random::<u64>()));
        let r = Root::bind("127.0.0.1", 0).unwrap();
        let port = r.port();
        let deadline = Instant::now() + Duration::from_secs(30);
        let served = {
            let tok = tok.clone();
            std::thread::spawn(move || {
                r.serve(&tok, 2, deadline, || {
                    Err(Error::Nccl {
                        op: "create NCCL id",
                        keys: vec![],
                        message: "no NCCL here".to_owned(),
                    })
                })
            })
        };
        let e = fetch("127.0.0.1", port, &tok, 1, 2, deadline).unwrap_err();
        match e {
            Error::RankExited {
                rank: 0, detail, ..
            } => assert!(detail.contains("no NCCL here")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(served.join().unwrap(), Err(Error::Nccl { .. })));
    }

    #[test]
    fn a_taken_port_is_an_error_naming_master_port() {
        let r = Root::bind("127.0.0.1", 0).unwrap();
        let e = Root::bind("127.0.0.1", r.port())
            .err()
            .expect("the port is taken");
        assert!(
            matches!(e, Error::DistEnv { ref var, .. } if var == "MASTER_PORT"),
            "{e}"
        );
    }
}
