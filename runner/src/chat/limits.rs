//! What keeps `--serve` safe to expose: the API key, the bind-address rule, and noticing a
//! client that went away.
//!
//! Owns: [`ApiKey`] (`--api-key` / `K3RUN_API_KEY`, checked in constant time, never printed),
//! [`bind_warning`] (loopback by default; a warning for another address without a key) and
//! [`Watcher`] (a thread that marks a request whose TCP connection closed, so its slot is
//! freed at the next step rather than when its reply is finished).
//! Must not: answer HTTP (the server does) or decode.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use subtle::ConstantTimeEq;

/// The environment variable read when `--api-key` is not given.
pub const API_KEY_ENV: &str = "K3RUN_API_KEY";

/// The key every request but `GET /health` must present as `Authorization: Bearer KEY`.
/// `Debug` does not show it.
#[derive(Clone)]
pub struct ApiKey(Vec<u8>);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

impl ApiKey {
    /// `--api-key` when given, else `K3RUN_API_KEY` when set; an empty key is refused (it
    /// would let every request in while looking protected).
    pub fn from_flag_or_env(flag: Option<&str>) -> Result<Option<ApiKey>, String> {
        let (key, source) = match flag {
            Some(k) => (k.to_string(), "--api-key"),
            None => match std::env::var(API_KEY_ENV) {
                Ok(k) => (k, API_KEY_ENV),
                Err(std::env::VarError::NotPresent) => return Ok(None),
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(format!("{API_KEY_ENV} is not valid UTF-8"));
                }
            },
        };
        if key.trim().is_empty() {
            return Err(format!(
                "{source} is empty: give a key, or unset it to serve without one"
            ));
        }
        Ok(Some(ApiKey(key.into_bytes())))
    }

    /// Whether an `Authorization` header value carries this key (`Bearer KEY`; the scheme
    /// case-insensitive). The comparison takes the same time wherever the first difference
    /// is (`subtle`); only the length of a wrong key can show in the timing.
    pub fn accepts(&self, authorization: Option<&str>) -> bool {
        let Some(v) = authorization else {
            return false;
        };
        let v = v.trim();
        let Some((scheme, token)) = v.split_once(' ') else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case("bearer") {
            return false;
        }
        bool::from(token.trim().as_bytes().ct_eq(&self.0))
    }
}

/// The warning to print when the server listens beyond this machine without an API key
/// (`None` for a loopback address, or with a key).
pub fn bind_warning(bound: &SocketAddr, key: Option<&ApiKey>) -> Option<String> {
    if key.is_some() || is_loopback(bound.ip()) {
        return None;
    }
    Some(format!(
        "warning: listening on {bound}, which other machines can reach, WITHOUT an API key: \
         anyone who can connect can use this model. Give --api-key KEY (or {API_KEY_ENV}), \
         or bind 127.0.0.1"
    ))
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v) => v.is_loopback(),
        IpAddr::V6(v) => v.is_loopback() || v.to_ipv4_mapped().is_some_and(|m| m.is_loopback()),
    }
}

/// A request's connection, found by its two addresses: every descriptor that held it when
/// the request arrived (tiny_http keeps a read and a write descriptor of each connection and
/// closes the read one once the client announced `Connection: close`).
#[derive(Debug, Clone)]
#[cfg_attr(not(target_os = "linux"), allow(dead_code))] // only Linux finds connections
struct Conn {
    fds: Vec<i32>,
    local: SocketAddr,
    peer: SocketAddr,
}

/// The socket of the connection `local` <-> `peer` among this process's descriptors
/// (tiny_http does not hand out its sockets). Linux only; `None` elsewhere or when not found.
#[cfg(target_os = "linux")]
fn find_socket(local: SocketAddr, peer: SocketAddr) -> Option<Conn> {
    let dir = std::fs::read_dir("/proc/self/fd").ok()?;
    let mut fds = Vec::new();
    for e in dir.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let is_socket = std::fs::read_link(e.path())
            .map(|t| t.to_string_lossy().starts_with("socket:"))
            .unwrap_or(false);
        if is_socket && sock_addr(fd, false) == Some(peer) && sock_addr(fd, true) == Some(local) {
            fds.push(fd);
        }
    }
    (!fds.is_empty()).then_some(Conn { fds, local, peer })
}

#[cfg(not(target_os = "linux"))]
fn find_socket(_local: SocketAddr, _peer: SocketAddr) -> Option<Conn> {
    None
}

/// getsockname (`local`) or getpeername of `fd` as a socket address.
#[cfg(target_os = "linux")]
fn sock_addr(fd: i32, local: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain data; the kernel writes at most `len` bytes into it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr>();
    // SAFETY: `p` points to a sockaddr_storage of `len` bytes; a bad fd only returns -1.
    let r = unsafe {
        if local {
            libc::getsockname(fd, p, &mut len)
        } else {
            libc::getpeername(fd, p, &mut len)
        }
    };
    if r != 0 {
        return None;
    }
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a: libc::sockaddr_in = unsafe { *(p.cast::<libc::sockaddr_in>()) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a: libc::sockaddr_in6 = unsafe { *(p.cast::<libc::sockaddr_in6>()) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(a.sin6_port)))
        }
        _ => None,
    }
}

/// Whether the connection is gone: none of its descriptors holds it any more (closed, or
/// reused for another connection), or TCP left the established state (the client closed or
/// reset it; HTTP clients do not half-close while they wait for an answer).
#[cfg(target_os = "linux")]
fn conn_gone(c: &Conn) -> bool {
    let Some(&fd) = c
        .fds
        .iter()
        .find(|&&fd| sock_addr(fd, false) == Some(c.peer) && sock_addr(fd, true) == Some(c.local))
    else {
        return true;
    };
    // SAFETY: tcp_info is plain data; the kernel writes at most `len` bytes.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is a tcp_info of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    // TCP_ESTABLISHED = 1 (include/net/tcp_states.h).
    r != 0 || info.tcpi_state != 1
}

#[cfg(not(target_os = "linux"))]
fn conn_gone(_c: &Conn) -> bool {
    false
}

/// Marks requests whose client went away: every `period` it checks the connection of each
/// watched request and raises that request's flag when it is gone. A request is watched
/// while its flag is alive (dropping the last `Arc` unwatches it).
#[derive(Debug, Clone)]
pub struct Watcher {
    watched: WatchList,
}

/// The watched connections, each with its request's flag.
type WatchList = Arc<Mutex<Vec<(Conn, Weak<AtomicBool>)>>>;

impl Watcher {
    /// Start the watching thread (it ends with the process).
    pub fn start(period: Duration) -> Watcher {
        let watched: WatchList = Arc::default();
        let w = Arc::downgrade(&watched);
        let spawned = std::thread::Builder::new()
            .name("k3-serve-watch".into())
            .spawn(move || {
                while let Some(list) = w.upgrade() {
                    {
                        let mut l = list.lock().unwrap_or_else(|e| e.into_inner());
                        l.retain(|(c, flag)| match flag.upgrade() {
                            None => false,
                            Some(f) if conn_gone(c) => {
                                f.store(true, Ordering::Relaxed);
                                false
                            }
                            Some(_) => true,
                        });
                    }
                    drop(list);
                    std::thread::sleep(period);
                }
            });
        if let Err(e) = spawned {
            eprintln!(
                "k3-run serve: cannot start the disconnect watcher ({e}): a client that goes \
                 away is noticed only when its reply is written"
            );
        }
        Watcher { watched }
    }

    /// Watch the connection `local` <-> `peer`; the returned flag is raised when it is gone.
    /// When the connection cannot be found (not Linux), the flag is never raised by the
    /// watcher (a streamed reply still notices a failed write).
    pub fn watch(&self, local: Option<SocketAddr>, peer: Option<SocketAddr>) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        if let (Some(local), Some(peer)) = (local, peer)
            && let Some(c) = find_socket(local, peer)
        {
            self.watched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((c, Arc::downgrade(&flag)));
        }
        flag
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_key_is_checked_exactly() {
        let k = ApiKey(b"s3cret".to_vec());
        assert!(k.accepts(Some("Bearer s3cret")));
        assert!(k.accepts(Some("bearer  s3cret ")));
        assert!(!k.accepts(Some("Bearer s3cre")));
        assert!(!k.accepts(Some("Bearer s3cretx")));
        assert!(!k.accepts(Some("Basic s3cret")));
        assert!(!k.accepts(Some("s3cret")));
        assert!(!k.accepts(None));
        assert_eq!(format!("{k:?}"), "ApiKey(<hidden>)");
    }

    #[test]
    fn only_a_reachable_address_without_a_key_warns() {
        let k = ApiKey(b"k".to_vec());
        let lo: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let lo6: SocketAddr = "[::1]:8080".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        assert!(bind_warning(&lo, None).is_none());
        assert!(bind_warning(&lo6, None).is_none());
        assert!(bind_warning(&any, Some(&k)).is_none());
        let w = bind_warning(&any, None).unwrap();
        assert!(w.contains("0.0.0.0:8080") && w.contains("--api-key"), "{w}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_closed_connection_is_noticed() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server_side, peer) = l.accept().unwrap();
        let local = server_side.local_addr().unwrap();
        let w = Watcher::start(Duration::from_millis(5));
        let flag = w.watch(Some(local), Some(peer));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !flag.load(Ordering::Relaxed),
            "an open connection is not gone"
        );
        drop(client);
        let t0 = std::time::Instant::now();
        while !flag.load(Ordering::Relaxed) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            flag.load(Ordering::Relaxed),
            "a closed connection is noticed"
        );
        drop(server_side);
    }
}
